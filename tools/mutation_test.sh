#!/usr/bin/env bash
# Mutation testing of the decisions with mutmut: the loss-scale state
# machine, the model's step and the three callbacks, each against its own
# targeted tests. Runs in a scratch copy of the repository (the work tree is
# never touched) and prints the kill rate and the surviving mutants.
#
#   tools/mutation_test.sh loss_scale            # about 7 minutes on 2 cores
#   tools/mutation_test.sh loss_scale_monitor    # likewise nan_gradient_monitor, epoch_timer, model, _gated_update
#   KEEP=1 tools/mutation_test.sh loss_scale "*from_argument*"   # some mutants; keep the copy
#                                                # (then: cd <copy> && mutmut show NAME)
#
# setup.cfg's [mutmut] section holds the shared settings (fork server,
# message text and logging not mutated); this script picks the module and
# its tests. "No tests" mutants count as survivors.
set -euo pipefail
module="${1:?usage: tools/mutation_test.sh loss_scale|loss_scale_monitor|nan_gradient_monitor|epoch_timer|model|_gated_update [MUTANT_GLOB]}"
glob="${2:-}"
case "$module" in
  loss_scale) tests="tests/test_loss_scale.py tests/test_loss_scale_bounds.py tests/test_contracts.py tests/test_distribute.py" ;;
  loss_scale_monitor) tests="tests/test_callback_arguments.py tests/test_loss_scale_monitor.py tests/test_callback_reuse.py tests/test_callbacks_integration.py" ;;
  nan_gradient_monitor) tests="tests/test_callback_arguments.py tests/test_nan_gradient_monitor.py tests/test_callback_reuse.py tests/test_diagnosis.py" ;;
  epoch_timer) tests="tests/test_callback_arguments.py tests/test_epoch_timer.py tests/test_callback_reuse.py tests/test_callbacks_integration.py" ;;
  model) tests="tests/test_model.py tests/test_model_state.py tests/test_contracts.py tests/test_diagnosis.py" ;;
  _gated_update) tests="tests/test_gated_update.py" ;;
  *) echo "tools/mutation_test.sh: error: unknown module '$module'" >&2; exit 2 ;;
esac
repo="$(cd "$(dirname "$0")/.." && pwd)"
python -m pip install --quiet "mutmut==3.8.1"
work="$(mktemp -d)"
if [ -n "${KEEP:-}" ]; then echo "scratch copy: $work"; else trap 'rm -rf "$work"' EXIT; fi
(cd "$repo" && git ls-files -z | tar --null -cf - -T -) | tar -xf - -C "$work"
cp "$repo"/tests/*.py "$work/tests/"  # the tests as they are now, committed or not
cd "$work"
# mutmut leaves decorated functions alone, and the hot path (the state
# machine's update, apply_gradients, the gradient check) is decorated with
# `@_no_autograph`. In the copy the decorator is applied at the end of the
# module instead, so that mutmut mutates these methods too.
python - "mp_callbacks/$module.py" <<'PY'
import re, sys
path = sys.argv[1]
out, wrapped, cls, decorated = [], [], None, False
for line in open(path).read().split("\n"):
    match = re.match(r"class (\w+)", line)
    cls = match.group(1) if match else cls
    if line.strip() == "@_no_autograph":
        decorated = True
        continue
    if decorated:
        name = re.match(r"\s*def (\w+)\(", line).group(1)
        wrapped.append(f"{cls}.{name}")
        decorated = False
    out.append(line)
out += [f"{name} = _no_autograph({name})" for name in wrapped]
open(path, "w").write("\n".join(out) + "\n")
PY
python - "$module" $tests <<'PY'
import re, sys
module, tests = sys.argv[1], sys.argv[2:]
text = open("setup.cfg").read()
text = re.sub(r"only_mutate =\n(    .*\n)+", f"only_mutate =\n    mp_callbacks/{module}.py\n", text)
text = re.sub(r"pytest_add_cli_args_test_selection =\n(    .*\n)+",
              "pytest_add_cli_args_test_selection =\n" + "".join(f"    {t}\n" for t in tests), text)
open("setup.cfg", "w").write(text)
PY
mutmut run ${glob:+"mp_callbacks.$module.$glob"} > mutmut-run.log 2>&1 || { tail -20 mutmut-run.log; exit 1; }
mutmut results --all true > results.txt 2>/dev/null
python - "$module" <<'PY'
import collections, re, sys
counts, survivors = collections.Counter(), []
for line in open("results.txt"):
    match = re.match(r"\s*(\S+): (.+)$", line)
    if match:
        counts[match.group(2)] += 1
        if match.group(2) in ("survived", "no tests"):
            survivors.append(f"{match.group(1)} ({match.group(2)})")
killed = counts["killed"] + counts["timeout"]
# "not checked": outside MUTANT_GLOB, so not part of this measurement.
total = sum(n for status, n in counts.items() if status != "not checked")
print(f"{sys.argv[1]}: {dict(counts)}")
print(f"kill rate: {killed}/{total} = {killed / total:.1%}")
for name in survivors:
    print("  survived: " + name)
PY
