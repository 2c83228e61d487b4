"""The code's shape, checked by reading it: imports go down docs/architecture.md's table, no function
over 100 lines, no reach into another package's private module, no backend name compared outside the
engines. Each rule with exceptions has an allow-list of today's exceptions, by name; a name
whose function got short (or whose import went) must leave its list, so the lists only shrink."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "platform" / "servetune"
MAX_FUNCTION_LINES = 100

#: Functions over MAX_FUNCTION_LINES today, as "module:Qualified.name" (split them, then strike them).
LONG_FUNCTIONS_ALLOWED: frozenset[str] = frozenset()

#: Imports of another package's private module today, as "importing module -> private module".
PRIVATE_IMPORTS_ALLOWED: frozenset[str] = frozenset()


def _modules() -> dict[str, ast.Module]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    return out


def _is_package(module: str) -> bool:
    return (PACKAGE.parent / module.replace(".", "/") / "__init__.py").is_file()


def long_functions(modules: dict[str, ast.Module]) -> dict[str, int]:
    """``"module:Qualified.name"`` -> lines (``def`` to its last line) of every function over the limit."""
    found: dict[str, int] = {}

    def visit(node: ast.AST, module: str, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                qual = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    lines = (child.end_lineno or child.lineno) - child.lineno + 1
                    if lines > MAX_FUNCTION_LINES:
                        found[f"{module}:{qual}"] = lines
                visit(child, module, qual + ".")
            else:
                visit(child, module, prefix)

    for module, tree in modules.items():
        visit(tree, module, "")
    return found


def private_imports(modules: dict[str, ast.Module]) -> set[str]:
    """``"importer -> servetune.pkg._mod"`` for every import of a private module from outside its package."""
    found: set[str] = set()
    for module, tree in modules.items():
        home = module if _is_package(module) else module.rpartition(".")[0]
        for node in ast.walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: resolve against the importer's package
                    anchor = home.split(".")
                    anchor = anchor[:len(anchor) - (node.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            for target in targets:
                parts = target.split(".")
                if parts[0] != "servetune":
                    continue
                for i, part in enumerate(parts[1:], start=1):
                    if part.startswith("_") and not part.startswith("__"):
                        private = ".".join(parts[:i + 1])
                        owner = ".".join(parts[:i])
                        if (PACKAGE.parent / (private.replace(".", "/") + ".py")).is_file() or _is_package(private):
                            if home != owner and not home.startswith(owner + "."):
                                found.add(f"{module} -> {private}")
                        break
    return found


def test_no_function_over_100_lines_but_the_listed_ones() -> None:
    found = long_functions(_modules())
    new = sorted(f"{name} ({lines} lines)" for name, lines in found.items() if name not in LONG_FUNCTIONS_ALLOWED)
    assert not new, f"functions over {MAX_FUNCTION_LINES} lines: {new}; split them into named steps"
    gone = sorted(LONG_FUNCTIONS_ALLOWED - found.keys())
    assert not gone, f"no longer over {MAX_FUNCTION_LINES} lines (or gone): {gone}; strike them from LONG_FUNCTIONS_ALLOWED"


def test_no_import_of_another_packages_private_module_but_the_listed_ones() -> None:
    found = private_imports(_modules())
    new = sorted(found - PRIVATE_IMPORTS_ALLOWED)
    assert not new, f"imports of another package's private module: {new}; import the package's face instead"
    gone = sorted(PRIVATE_IMPORTS_ALLOWED - found)
    assert not gone, f"no longer imported: {gone}; strike them from PRIVATE_IMPORTS_ALLOWED"


def test_the_checks_find_what_they_look_for() -> None:
    tree = ast.parse("def f():\n" + "    x = 1\n" * 120 + "class C:\n    def g(self):\n" + "        y = 2\n" * 101)
    assert long_functions({"servetune.m": tree}) == {"servetune.m:f": 121, "servetune.m:C.g": 102}
    imports = ast.parse("from servetune.records import _retry\nimport servetune.cluster._ray_session\n"
                        "from servetune.records._storage import x\nfrom servetune.records import dataset\n")
    assert private_imports({"servetune.study": imports}) == {
        "servetune.study -> servetune.records._retry", "servetune.study -> servetune.cluster._ray_session",
        "servetune.study -> servetune.records._storage"}
    assert private_imports({"servetune.records.tracking": imports}) == {
        "servetune.records.tracking -> servetune.cluster._ray_session"}


#: Backend names: code outside ``engines/`` asks ``servetune.backends.capabilities`` instead of
#: comparing a backend to one of them.
BACKEND_NAMES = frozenset({"vllm", "sim", "replay"})


def backend_compares(modules: dict[str, ast.Module]) -> set[str]:
    """``module:line`` of every ``==`` / ``!=`` between something and a backend name, outside ``engines``."""
    found = set()
    for name, tree in modules.items():
        if name.startswith("servetune.engines"):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Compare) and any(isinstance(op, (ast.Eq, ast.NotEq)) for op in node.ops):
                sides = [node.left, *node.comparators]
                if any(isinstance(s, ast.Constant) and s.value in BACKEND_NAMES for s in sides):
                    found.add(f"{name}:{node.lineno}")
    return found


def test_no_backend_name_is_compared_outside_the_engines() -> None:
    found = sorted(backend_compares(_modules()))
    assert not found, f"compare capabilities (servetune.backends), not backend names: {found}"
    assert backend_compares({"servetune.m": ast.parse("if backend != 'vllm':\n    pass\n")}) == {"servetune.m:1"}


def test_each_engine_declares_its_row_of_capabilities() -> None:
    from servetune.backends import CAPABILITIES
    from servetune.engines import ENGINES

    assert {name: engine.capabilities for name, engine in ENGINES.items()} == CAPABILITIES


ARCHITECTURE = PACKAGE.parents[1] / "docs" / "architecture.md"


def layers_from_docs(text: str) -> dict[str, int]:
    """The first column of docs/architecture.md's boundaries table, top to bottom: each package or
    top-level module named there -> its row (vocabulary is row 0, ``cli/`` the last)."""
    table = text[text.index("## The boundaries, and why each is there"):]
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| package")]
    order: dict[str, int] = {}
    for i, row in enumerate(rows):
        for name in re.findall(r"`([a-z_]+)(?:/|\.py)?`", row.split("|")[1]):
            order[name] = i
        if row.startswith("| `cli/`"):
            break
    return order


def upward_imports(modules: dict[str, ast.Module], order: dict[str, int]) -> set[str]:
    """``importer -> imported`` for every servetune import (in function bodies too) of a layer
    further down the table than the importer's; a module the table does not place is one too."""

    def row(module: str) -> int | None:
        parts = module.split(".")
        return order.get(parts[1]) if len(parts) > 1 else None

    found = set()
    for name, tree in modules.items():
        if name in ("servetune", "servetune.__main__"):
            continue  # the package's top: the command and its lazily loaded names
        mine = row(name)
        if mine is None:
            found.add(f"{name} (not in the table)")
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("servetune."):
                targets = [node.module or ""]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names if a.name.startswith("servetune.")]
            else:
                continue
            for target in targets:
                theirs = row(target)
                if theirs is None or theirs > mine:
                    found.add(f"{name} -> {target}")
    return found


def test_imports_go_down_the_architecture_table() -> None:
    order = layers_from_docs(ARCHITECTURE.read_text())
    assert order["errors"] == 0 and order["planner"] < order["sim"] < order["engines"] < order["spec"] < order["cli"]
    assert not sorted(upward_imports(_modules(), order))
    # The check finds what it looks for: a planner module reaching up into the engines.
    bad = {"servetune.planner.x": ast.parse("def f():\n    from servetune.engines import run_trial\n")}
    assert upward_imports(bad, order) == {"servetune.planner.x -> servetune.engines"}
