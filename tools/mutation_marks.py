"""Which lines of a module mutation testing leaves alone, found by what the
code does rather than by the names it uses (so a rename cannot silently
change what is mutated).

Two kinds of line are not decisions, so a mutant there is equivalent:

* **placeholders**: a private value that Keras's next hook sets again
  before anything reads it. A callback's `__init__` (or a method it and
  `on_train_begin` share) assigns `self.x`, and `on_epoch_begin` (or
  `on_train_begin`) assigns `self.x` again, unconditionally, and the hooks
  that run in between do not read it. The same for a `self.method(...)`
  call that `__init__` makes and `on_train_begin` makes again.
* **logging-only branches**: an `if` with no `else` whose body only logs
  (`logger.*`, `warnings.warn`).

    python tools/mutation_marks.py mp_callbacks/loss_scale_monitor.py   # prints the line numbers

`tools/mutation_test.sh` marks these lines `# pragma: no mutate` in its
scratch copy; `tests/test_mutation_config.py` checks the rules.
"""

from __future__ import annotations

import ast
import sys

FIT_START = "on_train_begin"
EPOCH_START = "on_epoch_begin"


def _self_attribute(node: ast.AST) -> str | None:
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
        return node.attr
    return None


def _assigned(statement: ast.stmt) -> list[str]:
    targets: list[ast.expr] = []
    if isinstance(statement, ast.Assign):
        targets = list(statement.targets)
    elif isinstance(statement, ast.AnnAssign) and statement.value is not None:
        targets = [statement.target]
    names = []
    for target in targets:
        for node in [target, *getattr(target, "elts", [])]:
            name = _self_attribute(node)
            if name:
                names.append(name)
    return names


def _self_call(statement: ast.stmt) -> str | None:
    if isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Call):
        return _self_attribute(statement.value.func)
    return None


def _methods(cls: ast.ClassDef) -> dict[str, ast.FunctionDef]:
    return {node.name: node for node in cls.body if isinstance(node, ast.FunctionDef)}


def _with_callees(name: str, methods: dict[str, ast.FunctionDef]) -> list[str]:
    """`name` and the methods it calls at its top level, transitively."""
    order, pending = [], [name]
    while pending:
        current = pending.pop()
        if current in order or current not in methods:
            continue
        order.append(current)
        pending += [c for c in map(_self_call, methods[current].body) if c]
    return order


def _reads(function: ast.FunctionDef) -> set[str]:
    return {
        node.attr
        for node in ast.walk(function)
        if isinstance(node, ast.Attribute)
        and isinstance(node.ctx, ast.Load)
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
    }


def _set_unconditionally(names: list[str], methods: dict[str, ast.FunctionDef]) -> set[str]:
    return {attr for name in names for statement in methods[name].body for attr in _assigned(statement)}


def placeholder_lines(cls: ast.ClassDef) -> set[int]:
    methods = _methods(cls)
    if EPOCH_START not in methods and FIT_START not in methods:
        return set()
    fit_start = _with_callees(FIT_START, methods)
    epoch_start = [EPOCH_START] if EPOCH_START in methods else []
    set_at_fit_start = _set_unconditionally(fit_start, methods) - {
        a for n in fit_start for a in _reads(methods[n]) if n == FIT_START
    }
    set_at_epoch_start = _set_unconditionally(epoch_start, methods) - {
        a for n in fit_start for a in _reads(methods[n])
    }
    before_fit = _with_callees("__init__", methods)
    lines = set()
    for name in set(before_fit) | set(fit_start):
        if name == EPOCH_START:
            continue
        for statement in methods[name].body:
            attributes = _assigned(statement)
            overwritten = set_at_epoch_start | (set_at_fit_start if name == "__init__" else set())
            # Public attributes can be read by the user before any fit.
            if attributes and all(a.startswith("_") for a in attributes) and set(attributes) <= overwritten:
                lines.add(statement.lineno)
    fit_start_calls = {c for c in map(_self_call, methods.get(FIT_START, ast.FunctionDef()).body or []) if c}
    for statement in methods.get("__init__", ast.FunctionDef()).body or []:
        if _self_call(statement) in fit_start_calls:
            lines.add(statement.lineno)
    return lines


def _only_logs(body: list[ast.stmt]) -> bool:
    def logs(statement: ast.stmt) -> bool:
        if not (isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Call)):
            return False
        func = statement.value.func
        return isinstance(func, ast.Attribute) and (
            isinstance(func.value, ast.Name) and func.value.id in ("logger", "logging", "warnings")
        )

    return bool(body) and all(map(logs, body))


def logging_branch_lines(tree: ast.Module) -> set[int]:
    return {
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and not node.orelse and _only_logs(node.body)
    }


def unmutated_lines(source: str) -> set[int]:
    tree = ast.parse(source)
    lines = logging_branch_lines(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            lines |= placeholder_lines(node)
    return lines


if __name__ == "__main__":
    with open(sys.argv[1]) as handle:
        print(" ".join(map(str, sorted(unmutated_lines(handle.read())))))
