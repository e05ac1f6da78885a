"""The package's import graph: its parts and the directions between them, no cycles, no module
using another module's private names, and the library independent of the test helpers.

Every `import` statement counts, at module level or inside a function: a lazy import hides a
cycle from the interpreter, not from a reader.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import mcore_proxy

ROOT = Path(mcore_proxy.__file__).parent


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _resolve(name: str) -> str | None:
    """The mcore_proxy module `name` refers to (a module, or a name inside one), else None."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str) -> list[tuple[str, str, int]]:
    """(imported module, imported name or "", line) for every import statement of `module`."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, "", node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                )
            for a in node.names:
                out.append((f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base, a.name, node.lineno))
    return [(m, n, line) for m, n, line in out if m.split(".")[0] == "mcore_proxy"]


def _graph() -> dict[str, set[str]]:
    graph = {}
    for module in MODULES:
        edges = {_resolve(m) for m, _, _ in _imports(module)}
        graph[module] = {m for m in edges if m and m != module}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path, or None (depth-first search with colours)."""
    colour, stack = {}, []

    def visit(node):
        colour[node] = "grey"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if colour.get(nxt) == "grey":
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in colour and (found := visit(nxt)):
                return found
        stack.pop()
        colour[node] = "black"
        return None

    for node in sorted(graph):
        if node not in colour and (found := visit(node)):
            return found
    return None


def test_the_checker_sees_a_cycle_and_a_private_import():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
    assert ("mcore_proxy.checkpoint.view", "ModelView") in {
        (m, n) for m, n, _ in _imports("mcore_proxy.checkpoint.inspect")
    }


def test_no_import_cycles():
    cycle = _cycle(_graph())
    assert cycle is None, " -> ".join(cycle)


def test_no_module_imports_another_modules_private_names():
    bad = [
        f"{MODULES[module].relative_to(ROOT.parent)}:{line} imports {name} from {imported}"
        for module in MODULES
        for imported, name, line in _imports(module)
        if name.startswith("_") and not name.startswith("__") and _resolve(imported) != module
    ]
    assert not bad, "\n".join(bad)


def test_tests_benchmarks_and_examples_use_only_public_names():
    """What a test or benchmark needs of a module is its public face: a private helper worth
    testing on its own is given a public name."""
    bad = []
    for folder in ("tests", "bench", "examples", "tools"):
        for path in sorted((ROOT.parent / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "mcore_proxy":
                    bad += [
                        f"{path.relative_to(ROOT.parent)}:{node.lineno} imports {a.name} from {node.module}"
                        for a in node.names
                        if a.name.startswith("_") and not a.name.startswith("__")
                    ]
    assert not bad, "\n".join(bad)


def test_the_library_does_not_import_the_test_helpers():
    """`mcore_proxy.testing` builds fixtures for tests; a library module that needs megatron-core
    on CPU uses `mcore_proxy.functional`."""
    bad = [
        f"{module} imports {imported}"
        for module in MODULES
        if not module.startswith("mcore_proxy.testing")
        for imported, _, _ in _imports(module)
        if imported.startswith("mcore_proxy.testing")
    ]
    assert not bad, "\n".join(bad)


# The parts of the package, bottom up, and the parts each may import (besides itself and the root
# `mcore_proxy`, which holds the version). The data flow is reader -> ModelView -> select/prune ->
# writer; a new arrow here is a design decision a reviewer should see. Command modules (each part's
# `cli.py` and `*_cli.py`, and `cli_support`) are the thin layer above them all: they may use every
# part of the library, and no library module imports them.
ALLOWED = {
    "core": set(),
    "mcore": {"core"},
    "runtime": {"core"},
    "cli_support": {"core"},
    "activation": {"core", "cli_support"},
    "engines": {"core"},
    "checkpoint": {"core", "mcore", "runtime", "cli_support", "engines"},
    "functional": {"core", "mcore", "engines", "checkpoint"},
    "select": {"core", "mcore", "runtime", "cli_support", "checkpoint"},
    "hf": {"core", "engines", "checkpoint", "select"},
    "convert": {"core", "mcore", "runtime", "cli_support", "checkpoint", "functional", "select", "hf"},
    "trace": {"core", "mcore", "cli_support", "activation", "engines", "checkpoint", "hf"},
    "faults": {"core", "activation", "engines", "trace"},
    "diagnose": {"core", "cli_support"},
    "campaign": {"core", "runtime", "cli_support", "activation", "diagnose", "faults"},
    "estimate": {"core", "mcore", "cli_support", "checkpoint", "select"},
    "fidelity": {"core", "cli_support", "checkpoint", "select", "hf", "convert"},
    "rollout": {"core", "cli_support", "activation", "engines", "checkpoint", "select", "hf", "trace", "faults"},
    "testing": {"core", "mcore", "checkpoint", "functional", "select", "convert", "trace"},
}
# the command-line entry points at the root: they may import every part, and no part imports them
ENTRY_POINTS = {"mcore_proxy.cli", "mcore_proxy.__main__"}


def _part(module: str) -> str | None:
    """The part (top-level subpackage) a module belongs to; None for the root's own modules."""
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and MODULES[module].name == "__init__.py") else None


def test_the_package_root_holds_only_the_entry_points_and_parts():
    loose = sorted(
        p.name
        for p in ROOT.iterdir()
        if p.name not in {"__init__.py", "__main__.py", "cli.py", "__pycache__"}
        and not (p.is_dir() and (p / "__init__.py").is_file())
    )
    assert not loose, f"give {loose} a home in one of the parts {sorted(ALLOWED)}"
    assert {_part(m) for m in MODULES} - {None} == set(ALLOWED), "every part has a row in ALLOWED"


def test_the_allowed_directions_have_no_cycle():
    assert _cycle({part: set(uses) for part, uses in ALLOWED.items()}) is None


def test_every_import_goes_in_an_allowed_direction():
    bad = []
    for module in MODULES:
        mine = _part(module)
        for imported, _, line in _imports(module):
            target = _resolve(imported)
            theirs = _part(target) if target else None
            where = f"{MODULES[module].relative_to(ROOT.parent)}:{line} imports {imported}"
            if target in ENTRY_POINTS and module not in ENTRY_POINTS:
                bad.append(f"{where}: nothing imports the command-line entry point")
            elif _is_command(module) and target is not None and not _is_command(target):
                continue  # a command is the top layer: it may use every part of the library
            elif mine is not None and theirs not in (None, mine) and theirs not in ALLOWED[mine]:
                bad.append(f"{where}: {mine} may import only {sorted(ALLOWED[mine])}")
    assert not bad, "\n".join(bad)


def _is_command(module: str) -> bool:
    """The command line: the entry points, each part's `cli.py` and `*_cli.py`, and `cli_support`
    (flags, plotting). Everything else is the library."""
    name = module.rsplit(".", 1)[-1]
    return module in ENTRY_POINTS or name == "cli" or name.endswith("_cli") or _part(module) == "cli_support"


def _command_imports(modules) -> list[str]:
    return [
        f"{module}:{line} imports {imported}"
        for module in modules
        if not _is_command(module)
        for imported, _, line in _imports(module)
        if (target := _resolve(imported)) and _is_command(target)
    ]


def test_the_library_never_imports_the_command_line():
    """What library code needs from its process (signals, memory, progress bars) is in `runtime`;
    a reader, writer or worker that imported a command module would drag argparse and the flag
    table into every training and rollout process that uses it."""
    bad = _command_imports(MODULES)
    assert not bad, "\n".join(bad)
    assert _is_command("mcore_proxy.trace.collect_cli") and not _is_command("mcore_proxy.runtime.memory")


# Inside a format: every module of a format package (`checkpoint/hf/`, `legacy/`, `torch_dist/`; the
# package's `__init__` is its interface) and the MindSpeed-LLM naming the Megatron formats share.
# Callers outside `checkpoint` reach them through `checkpoint/formats.py`, the `Format` and `Writer`
# records, the views, and each format package's `__init__`. `testing` builds fixture files of each
# format on purpose and is not a caller.
MINDSPEED_NAMING = {"mcore_proxy.checkpoint.mindspeed_llm", "mcore_proxy.checkpoint.mindspeed_llm_v4"}


def _inside_a_format(module: str) -> bool:
    parts = module.split(".")
    return module in MINDSPEED_NAMING or (
        len(parts) > 3 and parts[1] == "checkpoint" and MODULES[".".join(parts[:3])].name == "__init__.py"
    )


def _format_imports(modules) -> list[str]:
    return [
        f"{module}:{line} imports {imported}"
        for module in modules
        if _part(module) not in ("checkpoint", "testing")
        for imported, _, line in _imports(module)
        if (target := _resolve(imported)) and _inside_a_format(target)
    ]


def test_no_caller_imports_a_formats_modules():
    """checkpoint/interface.py's rule: what a caller needs of a format (a rank's state dict, the
    quantization it holds, which namings it writes) is a value of its interface."""
    bad = _format_imports(MODULES)
    assert not bad, "\n".join(bad)
    assert _inside_a_format("mcore_proxy.checkpoint.hf.native") and _inside_a_format(
        "mcore_proxy.checkpoint.mindspeed_llm"
    )
    assert not _inside_a_format("mcore_proxy.checkpoint.hf") and not _inside_a_format("mcore_proxy.checkpoint.view")


def test_the_format_and_command_checkers_see_a_violation(tmp_path, monkeypatch):
    """A module written for the occasion: a caller that reaches into the HF reader and imports a
    command's flags is caught by both checkers."""
    bad = tmp_path / "bad_caller.py"
    bad.write_text(
        "from mcore_proxy.checkpoint.hf.reader import HFCheckpoint\n"
        "from mcore_proxy.checkpoint import hf\n"
        "from mcore_proxy.cli_support.flags import add_flags\n"
    )
    monkeypatch.setitem(MODULES, "mcore_proxy.select.bad_caller", bad)
    assert _format_imports(["mcore_proxy.select.bad_caller"]) == [
        "mcore_proxy.select.bad_caller:1 imports mcore_proxy.checkpoint.hf.reader"
    ]
    assert len(_command_imports(["mcore_proxy.select.bad_caller"])) == 1


def test_the_direction_checker_sees_a_violation(monkeypatch):
    monkeypatch.setitem(ALLOWED, "core", set())
    monkeypatch.setitem(ALLOWED, "diagnose", {"core"})
    with pytest.raises(AssertionError, match="diagnose may import only"):
        test_every_import_goes_in_an_allowed_direction()
