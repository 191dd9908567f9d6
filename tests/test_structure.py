"""The library's structure, checked on its code: no two of its modules
import each other, directly or through others (a lazy import inside a
function counts too: it is the same dependency, hidden)."""

from __future__ import annotations

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "mp_callbacks"


def _module_name(path: pathlib.Path) -> str:
    """`backends.jax.step` for mp_callbacks/backends/jax/step.py."""
    return ".".join(path.relative_to(PACKAGE).with_suffix("").parts)


def _modules() -> list[pathlib.Path]:
    """Every module of the library, its subpackages' too."""
    return sorted(p for p in PACKAGE.rglob("*.py") if p.stem not in ("__init__", "__main__"))


def _imports(path: pathlib.Path) -> set[str]:
    """The mp_callbacks modules `path` imports, anywhere in it (dotted
    below the package: `backends.jax.step`)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "mp_callbacks" or node.module.startswith("mp_callbacks."):
                base = node.module.split(".")[1:]
                for alias in node.names:  # `from mp_callbacks.backends.jax import step`
                    as_module = PACKAGE.joinpath(*base, f"{alias.name}.py")
                    found.add(".".join([*base, alias.name]) if as_module.exists() else ".".join(base))
        elif isinstance(node, ast.Import):
            found |= {
                ".".join(alias.name.split(".")[1:])
                for alias in node.names
                if alias.name.startswith("mp_callbacks.")
            }
    try:
        own = _module_name(path)
    except ValueError:  # a probe outside the package
        own = path.stem
    return {name for name in found if name} - {own, "__init__"}


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every import circle: a path from a module back to itself."""
    circles = []

    def walk(module: str, path: list[str]) -> None:
        for imported in sorted(graph.get(module, ())):
            if imported == path[0]:
                circles.append([*path, imported])
            elif imported not in path and imported > path[0]:
                walk(imported, [*path, imported])

    for module in sorted(graph):
        walk(module, [module])
    return circles


def test_no_import_circle_between_the_librarys_modules():
    graph = {_module_name(path): _imports(path) for path in _modules()}
    assert graph.get("loss_scale"), "the import scan found nothing"
    assert "backends.jax.step" in graph["backends.jax.model"]
    assert _circles(graph) == []


def test_the_circle_search_finds_a_lazy_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _circles(graph) == [["a", "b", "c", "a"]]
    assert _circles({"a": {"b"}, "b": set()}) == []


def test_a_lazy_import_is_an_import(tmp_path):
    module = tmp_path / "probe.py"
    module.write_text(
        "from mp_callbacks import loss_scale\n"
        "def f():\n"
        "    from mp_callbacks.model import MixedPrecisionModel\n"
        "    import mp_callbacks.tuner\n"
    )
    assert _imports(module) == {"loss_scale", "model", "tuner"}


# A function longer than this (code, not its docstring) does several jobs.
MAX_FUNCTION_LINES = 85


def _code_lines(function: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    body = function.body
    if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    return 0 if not body else body[-1].end_lineno - body[0].lineno + 1  # type: ignore[operator]


def test_no_function_of_the_library_is_longer_than_about_80_lines():
    long = [
        f"{path.name}:{node.lineno} {node.name} ({_code_lines(node)} lines)"
        for path in _modules()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and _code_lines(node) > MAX_FUNCTION_LINES
    ]
    assert long == []


def test_code_lines_leave_out_the_docstring():
    function = ast.parse('def f():\n    """Doc.\n\n    More.\n    """\n    a = 1\n    return a\n').body[0]
    assert _code_lines(function) == 2


def _functions(tree: ast.AST) -> dict[str, ast.FunctionDef]:
    return {n.name: n for n in ast.iter_child_nodes(tree) if isinstance(n, ast.FunctionDef)}


def _calls(function: ast.FunctionDef) -> list[tuple[int, str]]:
    """(line, name) of every call in `function`, `f(...)` and `x.f(...)`."""
    return sorted(
        (node.lineno, getattr(node.func, "id", None) or getattr(node.func, "attr", ""))
        for node in ast.walk(function)
        if isinstance(node, ast.Call)
    )


def test_the_tensorflow_loss_scaler_hands_its_step_to_the_step_module():
    """`LossScaler` is the public scale object: its step methods are a few
    lines each that call `backends/tensorflow/step.py`; the step's own
    work is not in the class."""
    tree = ast.parse((PACKAGE / "loss_scale.py").read_text())
    scaler = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "LossScaler")
    methods = _functions(scaler)
    for name in ("apply_gradients", "step", "update", "recording", "finish_step", "_update_state"):
        handed = [
            node
            for node in ast.walk(methods[name])
            if isinstance(node, ast.Attribute) and getattr(node.value, "id", None) == "tf_step"
        ]
        assert handed and _code_lines(methods[name]) <= 6, name
    moved = {"_apply_unscaled", "_advance", "_plain_optimizer", "_combined_flags", "_full_flags", "_pending"}
    assert not moved & set(methods)


def test_the_tensorflow_step_reads_top_to_bottom():
    """Check once, decide once, apply or skip, update the state: in that
    order in `apply_unscaled`, each once."""
    step = _functions(ast.parse((PACKAGE / "backends" / "tensorflow" / "step.py").read_text()))
    calls = _calls(step["apply_unscaled"])
    order = ["check_gradients", "decision", "apply_or_skip", "_advance"]
    lines = [[line for line, name in calls if name == wanted] for wanted in order]
    assert [len(found) for found in lines] == [1, 1, 1, 1], dict(zip(order, lines))
    assert [found[0] for found in lines] == sorted(found[0] for found in lines)


def _defined_attributes() -> set[str]:
    """Every attribute name the library itself defines: methods, class
    attributes (`x = ...` and `x: T` in a class body), `self.x = ...` and
    `object.__setattr__(self, "x", ...)`."""
    names = set()
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                for statement in node.body:
                    targets = statement.targets if isinstance(statement, ast.Assign) else []
                    if isinstance(statement, ast.AnnAssign):
                        targets = [statement.target]
                    names.update(t.id for t in targets if isinstance(t, ast.Name))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif (
                isinstance(node, ast.Call)
                and getattr(node.func, "attr", None) == "__setattr__"
                and len(node.args) > 1
                and isinstance(node.args[1], ast.Constant)
            ):
                names.add(node.args[1].value)
    return names


def _foreign_private_names(path: pathlib.Path, ours: set[str]) -> list[str]:
    return [
        f"{path.name}:{node.lineno} .{node.attr}"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Attribute)
        and node.attr.startswith("_")
        and not node.attr.startswith("__")
        and node.attr not in ours
    ]


def test_the_backends_use_no_private_name_the_library_does_not_define():
    # The backends' modules import JAX, so the fence test of
    # tests/test_keras_internals.py (which imports each module) cannot read
    # them here: any private attribute they touch must be the library's own.
    ours = _defined_attributes()
    breaches = [
        b for path in (PACKAGE / "backends").rglob("*.py") for b in _foreign_private_names(path, ours)
    ]
    assert breaches == []


def test_a_private_keras_name_in_a_backend_is_found(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("def step(model):\n    return model._update_metrics_variables, model._mp_state\n")
    assert _foreign_private_names(probe, _defined_attributes()) == ["probe.py:2 ._update_metrics_variables"]


def test_the_library_keeps_no_thread_local_tables():
    """What a step remembers while traced is held by its object (the
    scaler's `StepTraces`), so it dies with it: no module-level
    `threading.local()` keyed by object ids."""
    found = [
        f"{path.relative_to(PACKAGE)}:{node.lineno}"
        for path in _modules()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Attribute)
        and node.attr == "local"
        and getattr(node.value, "id", "") == "threading"
    ]
    assert found == []
