#!/usr/bin/env bash
# Mutation testing of the decisions: the loss-scale state machine, the
# model's step and the three callbacks, against their targeted tests
# (setup.cfg's [mutmut] section). Runs mutmut in a scratch copy of the
# repository, so the work tree is never touched, and prints the kill rate.
#
#   tools/mutation_test.sh                              # every configured module (about 1.5 h on 2 cores)
#   tools/mutation_test.sh "mp_callbacks.loss_scale.*"  # one module's mutants
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
python -m pip install --quiet "mutmut==3.8.1"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
(cd "$repo" && git ls-files -z | tar --null -cf - -T -) | tar -xf - -C "$work"
cd "$work"
mutmut run "$@" > mutmut-run.log 2>&1 || true
mutmut results --all true > results.txt 2>/dev/null || true
python - "$@" <<'PY'
import collections, re, sys
counts = collections.Counter()
survivors = []
for line in open("results.txt"):
    match = re.match(r"\s*(\S+): (.+)$", line)
    if match:
        counts[match.group(2)] += 1
        if match.group(2) == "survived":
            survivors.append(match.group(1))
tested = counts["killed"] + counts["survived"] + counts["timeout"]
print(dict(counts))
if tested:
    killed = counts["killed"] + counts["timeout"]
    print(f"kill rate: {killed}/{tested} = {killed / tested:.1%} (timeouts count as killed)")
print("survivors:")
for name in survivors:
    print("  " + name)
PY
