#!/usr/bin/env bash
# Mutation testing of the decisions with mutmut, one module of mp_callbacks/
# at a time against its own tests (derived below). Runs in a scratch copy of
# the repository (the work tree is never touched) and prints the kill rate
# and the surviving mutants.
#
#   tools/mutation_test.sh _scale_state          # the state machine
#   tools/mutation_test.sh loss_scale_monitor    # likewise any module
#   KEEP=1 tools/mutation_test.sh loss_scale "*from_argument*"   # some mutants; keep the copy
#                                                # (then: cd <copy> && mutmut show NAME)
#   TESTS="tests/test_loss_scale.py" tools/mutation_test.sh loss_scale   # these tests only
#
# setup.cfg's [mutmut] section holds the shared settings and the text not
# mutated (messages, logging); tools/mutation_marks.py finds placeholders and
# logging-only branches by what they do; [tool:mutation_test] names the
# functions not mutated. "No tests" mutants count as survivors.
set -euo pipefail
module="${1:?usage: tools/mutation_test.sh MODULE [MUTANT_GLOB] (MODULE: a file of mp_callbacks/ without .py, such as loss_scale or backends/tensorflow/gated_update)}"
glob="${2:-}"
repo="$(cd "$(dirname "$0")/.." && pwd)"
[ -f "$repo/mp_callbacks/$module.py" ] || { echo "tools/mutation_test.sh: error: no module mp_callbacks/$module.py" >&2; exit 2; }
# The module's tests, derived unless TESTS names them: tests/test_<module>*.py
# (tests mirror the modules), and every test file whose code (not its text)
# names the module or one of its public names. Tests marked slow are left
# out (setup.cfg's pytest_add_cli_args): they are whole fits and examples.
tests="${TESTS:-$(cd "$repo" && python - "$module" <<'PY'
import ast, pathlib, sys
module = sys.argv[1]
tree = ast.parse(pathlib.Path(f"mp_callbacks/{module}.py").read_text())
names = set()
for node in tree.body:
    if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "__all__" for t in node.targets):
        names = {elt.value for elt in node.value.elts}
stem = module.split("/")[-1].lstrip("_")
found = []
for path in sorted(pathlib.Path("tests").glob("test_*.py")):
    used = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Name):
            used.add(node.id)
        elif isinstance(node, ast.Attribute):
            used.add(node.attr)
        elif isinstance(node, ast.alias):
            used.update(node.name.split("."))
    if path.name.startswith(f"test_{stem}") or module.split("/")[-1] in used or used & names:
        found.append(str(path))
print(" ".join(found))
PY
)}"
echo "tests: $tests"
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
python - "mp_callbacks/$module.py" "$repo/tools" <<'PY'
import re, sys
path = sys.argv[1]
sys.path.insert(0, sys.argv[2])
from mutation_marks import unmutated_lines
# Placeholders and logging-only branches (by what they do), marked first,
# while the line numbers are the module's own.
source = open(path).read().split("\n")
for number in unmutated_lines("\n".join(source)):
    source[number - 1] += "  # pragma: no mutate"
out, wrapped, cls, decorated = [], [], None, False
for line in source:
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
# Functions setup.cfg's [tool:mutation_test] keeps unmutated.
import configparser
config = configparser.ConfigParser()
config.read("setup.cfg")
text = "\n".join(out) + "\n"
for entry in config.get("tool:mutation_test", "no_mutate_functions", fallback="").strip().splitlines():
    file, _, start = entry.partition(": ")
    if file.strip() == path:
        lines = text.split("\n")
        for i, line in enumerate(lines):
            if start in line and line.rstrip().endswith(":"):
                lines[i] = line + "  # pragma: no mutate block"
        text = "\n".join(lines)
open(path, "w").write(text)
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
mutmut run ${glob:+"mp_callbacks.${module//\//.}.$glob"} > mutmut-run.log 2>&1 || { tail -20 mutmut-run.log; exit 1; }
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
