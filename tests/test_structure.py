"""The library's structure, checked on its code: no two of its modules
import each other, directly or through others (a lazy import inside a
function counts too: it is the same dependency, hidden)."""

from __future__ import annotations

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "mp_callbacks"


def _imports(path: pathlib.Path) -> set[str]:
    """The mp_callbacks modules `path` imports, anywhere in it."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "mp_callbacks":
                found |= {alias.name for alias in node.names if (PACKAGE / f"{alias.name}.py").exists()}
            elif node.module.startswith("mp_callbacks."):
                found.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            found |= {
                alias.name.split(".")[1] for alias in node.names if alias.name.startswith("mp_callbacks.")
            }
    return found - {path.stem, "__init__"}


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
    graph = {
        path.stem: _imports(path)
        for path in PACKAGE.glob("*.py")
        if path.stem not in ("__init__", "__main__")
    }
    assert graph.get("loss_scale"), "the import scan found nothing"
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
        for path in sorted(PACKAGE.glob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and _code_lines(node) > MAX_FUNCTION_LINES
    ]
    assert long == []


def test_code_lines_leave_out_the_docstring():
    function = ast.parse('def f():\n    """Doc.\n\n    More.\n    """\n    a = 1\n    return a\n').body[0]
    assert _code_lines(function) == 2
