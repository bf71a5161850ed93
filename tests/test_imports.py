"""The package's imports run one way: no module imports, at module level or inside a function, a module
that imports it back (directly or through others)."""

import ast
from pathlib import Path

import pagedkv

PACKAGE = Path(pagedkv.__file__).parent


def module_names(root: Path, package: str) -> dict[str, Path]:
    """Every module of the package under `root`: dotted name -> file (a package is its __init__.py)."""
    out = {}
    for path in root.rglob("*.py"):
        parts = [package, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that `name` imports anywhere in its file (module level, functions, methods)."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")[:len(name.split(".")) - node.level + is_package]
                base = ".".join(base + ([node.module] if node.module else []))
            else:
                base = node.module
            submodules = [f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in modules]
            # names that are not modules come from base's own file (a package: its __init__.py)
            targets = submodules + ([base] if len(submodules) < len(node.names) else [])
        else:
            continue
        for target in targets:
            while target and target not in modules:  # `from pkg import name`: the module pkg.name, else pkg
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node):
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    modules = module_names(root, package)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def test_pagedkv_imports_have_no_cycle():
    graph = import_graph(PACKAGE, "pagedkv")
    assert len(graph) > 40 and graph["pagedkv.cli"] >= {"pagedkv.options", "pagedkv.parallel.commands"}
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_commands_share_their_options_from_below():
    graph = import_graph(PACKAGE, "pagedkv")
    for command in ("pagedkv.engine.server", "pagedkv.parallel.commands", "pagedkv.evaluate"):
        assert "pagedkv.cli" not in graph[command]
    assert "pagedkv.options" in graph["pagedkv.parallel.commands"]


def test_a_cycle_through_an_import_inside_a_function_is_found(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from .b import thing\n")
    (pkg / "a.py").write_text("def f():\n    from .sub import b\n    return b\n")
    (pkg / "sub" / "b.py").write_text("thing = 1\n\ndef g():\n    from ..a import f\n    return f\n")
    graph = import_graph(pkg, "pkg")
    assert graph["pkg.a"] == {"pkg.sub.b"} and graph["pkg.sub"] == {"pkg.sub.b"}
    assert find_cycle(graph) == ["pkg.a", "pkg.sub.b", "pkg.a"]
    (pkg / "sub" / "b.py").write_text("thing = 1\n")
    assert find_cycle(import_graph(pkg, "pkg")) is None


def test_script_folders_shadow_no_installed_package():
    """bench/ and tests/ go on sys.path when their scripts run, so a module there named like an installed
    package (or the standard library's) hides it from every import after, transformers' included
    (transformers 5.25 imports the `kernels` package, once the name of a benchmark script)."""
    import importlib.metadata
    import sys

    taken = set(importlib.metadata.packages_distributions()) | set(sys.stdlib_module_names)
    root = PACKAGE.parent
    clashes = sorted(f"{folder}/{path.name}" for folder in ("bench", "tests")
                     for path in (root / folder).glob("*.py") if path.stem in taken)
    assert not clashes, f"rename {clashes}: an installed package or the standard library has that name"
