"""The package layout: one installed namespace, the import rules between its parts, no cycles.

Read from the source tree (no imports of the product), so a violation names the file and line.
"""

from __future__ import annotations

import ast
import pathlib
import re

import pytest
import tomllib

REPO = pathlib.Path(__file__).resolve().parents[2]
# repository folder -> the package it installs as (pyproject.toml's package-dir)
ROOTS = {"ftsdp": "ftsdp", "storage": "ftsdp.storage", "tools": "ftsdp.tools"}


def _modules() -> dict[str, pathlib.Path]:
    """Every module of the product by its installed dotted name."""
    out = {}
    for folder, package in ROOTS.items():
        for path in sorted((REPO / folder).rglob("*.py")):
            rel = path.relative_to(REPO / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            out[".".join([package, *parts])] = path
    return out


MODULES = _modules()
# Development scripts (fuzz, stress, the scale simulation) run from a checkout; the wheel does
# not ship them (docs/design.md, "The map").
NOT_SHIPPED = {"ftsdp.tools.dev"}


def _imports(name: str, path: pathlib.Path) -> list[tuple[int, str]]:
    """``(line, module)`` of every import in a file, relative ones resolved; an imported name
    that is itself a module (``from ftsdp import storage``) counts as that module."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, base] if base else parent)
            for a in node.names:
                sub = f"{base}.{a.name}"
                found.append((node.lineno, sub if sub in MODULES else base))
    return found


def _graph() -> dict[str, set[str]]:
    """Module -> the product modules it imports (a submodule import also runs its packages)."""
    graph: dict[str, set[str]] = {}
    for name, path in MODULES.items():
        deps = set()
        for _, target in _imports(name, path):
            parts = target.split(".")
            for i in range(1, len(parts) + 1):
                dep = ".".join(parts[:i])
                # importing a package's submodule runs the package's __init__ first, but a
                # module importing its own package's __init__ is the import system's own order
                if dep in MODULES and dep != name and not name.startswith(dep + "."):
                    deps.add(dep)
        graph[name] = deps
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycles() -> None:
    assert _cycles(_graph()) == []


def _violations(prefix: str, allowed) -> list[str]:
    bad = []
    for name, path in MODULES.items():
        if name == prefix or name.startswith(prefix + "."):
            for line, target in _imports(name, path):
                if target.split(".")[0] == "ftsdp" and not allowed(target):
                    bad.append(f"{path.relative_to(REPO)}:{line} imports {target}")
    return bad


def _within(*packages: str):
    return lambda target: any(target == p or target.startswith(p + ".") for p in packages)


def _room_map() -> dict[str, set[str] | None]:
    """docs/design.md's map: room -> the rooms it may import (None: anything)."""
    text = (REPO / "docs" / "design.md").read_text()
    table = text.split("## The map", 1)[1].split("\n## ", 1)[0]
    rooms: dict[str, str] = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("`ftsdp"):
            rooms[cells[0].strip("`")] = cells[2]
    out: dict[str, set[str] | None] = {}
    for room, may in rooms.items():
        if may == "anything" or may.startswith("public names of any room"):
            out[room] = None
            continue
        names = set(re.findall(r"`([a-z_.]+)`", may))
        if may.startswith("every storage room"):
            names = {r for r in rooms if r.startswith("ftsdp.storage.")}
        # short names inside storage (`io`) are storage's rooms
        out[room] = {n if n.startswith("ftsdp") else f"ftsdp.storage.{n}" for n in names}
    return out


MAP = _room_map()


def _room_of(module: str) -> str:
    """The room a module lives in: the longest room name that is a dotted prefix of it."""
    found = [r for r in MAP if module == r or module.startswith(r + ".")]
    return max(found, key=len)


def test_the_map_lists_every_package_as_a_room() -> None:
    packages = {n for n, p in MODULES.items() if p.name == "__init__.py"}
    assert set(MAP) == packages


def test_the_unit_tests_mirror_the_rooms() -> None:
    """Each room's unit tests live in a folder of the same path under tests/unit
    (``ftsdp.storage.io`` -> tests/unit/storage/io, the benchmarks of ``ftsdp.tools`` ->
    tests/unit/tools), and no tests folder names a room that does not exist (docs/design.md,
    "The map"). ``ftsdp`` and ``ftsdp.storage`` are tested through their rooms and tests/unit's
    own modules; ``ftsdp.testing`` by the tests that use it."""
    paths = {room: "/".join(room.split(".")[1:]) for room in MAP if room != "ftsdp.testing"}
    unit = REPO / "tests" / "unit"
    found = {
        str(d.relative_to(unit)).replace(".", "")  # tests/unit itself: ""
        for d in [unit, *unit.rglob("*")]
        if d.is_dir() and any(d.glob("test_*.py"))
    }
    expected = set(paths.values())
    assert expected - {"", "storage"} <= found, sorted(expected - found)
    assert found <= expected, sorted(found - expected)


def test_every_import_follows_the_map_in_docs_design_md() -> None:
    bad = []
    for name, path in MODULES.items():
        room = _room_of(name)
        allowed = MAP[room]
        if allowed is None:
            continue
        for line, target in _imports(name, path):
            if target.split(".")[0] != "ftsdp":
                continue
            to = _room_of(target)
            # a storage room uses storage's shared modules (_errors, _options); a room that
            # may import storage may use its public rooms too
            ok = (
                to == room
                or to in allowed
                or (to == "ftsdp.storage" and room.startswith("ftsdp.storage."))
                or ("ftsdp.storage" in allowed and to.startswith("ftsdp.storage."))
            )
            if not ok:
                bad.append(f"{path.relative_to(REPO)}:{line} ({room}) imports {target} ({to})")
    assert bad == []


def test_the_map_checker_sees_a_violation() -> None:
    assert _room_of("ftsdp.storage.saving._save") == "ftsdp.storage.saving"
    assert _room_of("ftsdp.storage._errors") == "ftsdp.storage"
    assert _room_of("ftsdp.train") == "ftsdp"
    assert "ftsdp.storage.saving" not in (MAP["ftsdp.storage.format"] or ())
    assert MAP["ftsdp.fsdp"] == set()


def test_storage_imports_nothing_else_of_ftsdp() -> None:
    assert _violations("ftsdp.storage", _within("ftsdp.storage")) == []


def test_engine_and_elastic_do_not_import_each_other_or_the_trainer() -> None:
    assert _violations("ftsdp.fsdp", _within("ftsdp.fsdp")) == []
    assert _violations("ftsdp.elastic", _within("ftsdp.elastic")) == []


def test_tools_use_public_names_only() -> None:
    def public(target: str) -> bool:
        if target.startswith("ftsdp.tools"):
            return True
        return not any(part.startswith("_") for part in target.split(".")[1:])

    bad = _violations("ftsdp.tools", public)
    assert [b for b in bad if not b.startswith("tools/dev/")] == []


def test_no_code_imports_the_old_top_level_names() -> None:
    pattern = re.compile(r"^\s*(import|from)\s+(storage|tools)\b", re.M)
    bad = [
        str(p.relative_to(REPO))
        for folder in (*ROOTS, "tests")
        for p in (REPO / folder).rglob("*.py")
        if pattern.search(p.read_text())
    ]
    assert bad == []


def test_pyproject_lists_every_package_with_its_folder() -> None:
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert config["package-dir"] == {v: k for k, v in ROOTS.items()}
    packages = sorted(
        n for n, p in MODULES.items() if p.name == "__init__.py" and n not in NOT_SHIPPED
    )
    assert sorted(config["packages"]) == packages


def test_top_level_exports_are_listed_once_and_resolve() -> None:
    import ftsdp

    assert sorted(ftsdp.__all__) == sorted(ftsdp._EXPORTS)
    assert len(ftsdp.__all__) <= 12  # a small surface: the rest stays in the subpackages
    for name in ftsdp.__all__:
        assert getattr(ftsdp, name).__name__ in (name, "FullyShardedDataParallel")
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        ftsdp.nope  # noqa: B018


ROOMS = ["catalog", "conversion", "format", "inference", "io", "loading", "saving"]


def test_storage_exports_a_small_surface_and_each_room_its_own() -> None:
    import importlib

    from ftsdp import storage

    assert len(storage.__all__) <= 22 and len(set(storage.__all__)) == len(storage.__all__)
    assert sorted(n for n in dir(storage) if not n.startswith("_")) == sorted(
        [*storage.__all__, *ROOMS]
    )
    for name in storage.__all__:
        assert getattr(storage, name).__name__ == name
    for room in ROOMS:
        module = importlib.import_module(f"ftsdp.storage.{room}")
        assert module.__doc__ and len(module.__doc__.splitlines()) == 1, room
        assert module.__all__ and len(set(module.__all__)) == len(module.__all__), room
        for name in module.__all__:
            value = getattr(module, name)
            assert getattr(value, "__name__", name) == name, (room, name)
            if name in storage.__all__:
                assert getattr(storage, name) is value  # one object, whichever the import
        assert set(module.__all__) <= set(dir(module)), room
        with pytest.raises(AttributeError, match="no attribute 'nope'"):
            module.nope  # noqa: B018
    assert "KeptState" not in {n for r in ROOMS for n in dir(storage.__dict__[r])}


def test_save_takes_at_most_eight_parameters() -> None:
    import inspect

    from ftsdp import storage
    from ftsdp.storage import saving

    assert len(inspect.signature(storage.save).parameters) <= 8
    nodes = inspect.signature(saving.save_on_nodes).parameters
    assert nodes["node"].kind is inspect.Parameter.KEYWORD_ONLY
    assert nodes["node"].default is inspect.Parameter.empty  # required: a node-local root
    with pytest.raises(ValueError, match="keep_last=0 must be an int >= 1"):
        storage.SaveOptions(keep_last=0)
    with pytest.raises(ValueError, match="keep_every=2.5 must be an int >= 1"):
        storage.SaveOptions(keep_every=2.5)


@pytest.mark.parametrize(
    ("package", "name", "new"),
    [
        ("ftsdp", "StateDictType", "ftsdp.fsdp"),
        ("ftsdp", "FullStateDictConfig", "ftsdp.fsdp"),
        ("ftsdp", "ShardView", "ftsdp.fsdp"),
        ("ftsdp", "CommStats", "ftsdp.fsdp"),
        ("ftsdp.storage", "verify", "ftsdp.storage.catalog"),
        ("ftsdp.storage", "convert", "ftsdp.storage.conversion"),
        ("ftsdp.storage", "Manifest", "ftsdp.storage.format"),
        ("ftsdp.storage", "restore_on_nodes", "ftsdp.storage.saving"),
        ("ftsdp.storage", "DEFAULT_MAX_MEMORY", "ftsdp.storage.io"),
        ("ftsdp.trainer", "CheckpointManager", "ftsdp.checkpoint"),
    ],
)
def test_old_top_level_names_resolve_with_a_warning_naming_the_new_import(
    package: str, name: str, new: str
) -> None:
    import importlib

    module, moved_to = importlib.import_module(package), importlib.import_module(new)
    assert name not in module.__all__ and name not in dir(module)
    with pytest.warns(DeprecationWarning, match=f"use `from {new} import {name}`"):
        value = getattr(module, name)
    assert value is getattr(moved_to, name) and name in moved_to.__all__


def test_the_repository_speaks_for_itself() -> None:
    """No code or doc points to design files outside the repository."""
    pattern = re.compile(r"\b(DESIGN|FIELD|STYLE)\.md\b|\.\./shared\b")
    files = [p for folder in (*ROOTS, "tests", "docs") for p in (REPO / folder).rglob("*.*")]
    files += [REPO / "README.md", REPO / "pyproject.toml"]
    bad = [
        str(p.relative_to(REPO))
        for p in files
        if p.suffix in (".py", ".md", ".toml", ".sh") and pattern.search(p.read_text())
    ]
    assert bad == []


def test_the_product_imports_testing_only_where_the_entry_plugs_the_fault_hook_in() -> None:
    """``ftsdp.testing`` is imported by tests, by itself, by the benchmarks and the fuzzer (its
    gloo rank spawner); by the product only in ``ftsdp/train.py``, once, inside a function (the
    branch taken when ``FTSDP_FAULT`` is set)."""

    def not_testing(target: str) -> bool:
        return not _within("ftsdp.testing")(target)

    allowed = ("ftsdp/testing/", "tools/bench_", "tools/_bench_", "tools/dev/")
    bad = [v for v in _violations("ftsdp", not_testing) if not v.startswith(allowed)]
    entry = MODULES["ftsdp.train"]
    assert len(bad) == 1 and bad[0].startswith(f"{entry.relative_to(REPO)}:"), bad
    line = int(bad[0].split(":")[1].split()[0])
    tree = ast.parse(entry.read_text())
    top_level = {n.lineno for n in tree.body if isinstance(n, ast.Import | ast.ImportFrom)}
    assert line not in top_level, "import ftsdp.testing lazily, only when FTSDP_FAULT is set"
    plug_in = next(
        f
        for f in ast.walk(tree)
        if isinstance(f, ast.FunctionDef) and f.lineno <= line <= (f.end_lineno or 0)
    )
    assert "FTSDP_FAULT" in ast.get_source_segment(entry.read_text(), plug_in)


def test_every_source_file_the_docs_name_exists() -> None:
    """A file of the tree named in README.md or docs/ (``ftsdp/fsdp/_unit.py``) is there: a
    module joined into another must take its mentions along."""
    pattern = re.compile(r"\b(?:ftsdp|storage|tools|tests)/[\w/]+\.(?:py|sh|md)\b")
    missing = [
        f"{doc.relative_to(REPO)}:{n}: {path}"
        for doc in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
        for n, line in enumerate(doc.read_text().splitlines(), 1)
        for path in pattern.findall(line)
        if not (REPO / path).exists()
    ]
    assert not missing, "\n".join(missing)
