"""One-way dependencies inside ``src/gangrun`` (docs/architecture.md).

Every import of a gangrun module (top level or inside a function, ``TYPE_CHECKING`` blocks
included) is read with ``ast``. A module may import its own layer or lower ones, never a
higher one; the rank side (code that runs inside a rank process) imports only the rank side
and the platform helpers; and there is no import cycle between modules.

Update the table when a module is added: a module not listed fails the test.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"

# layer: higher imports lower, never the reverse. Prefix match on the dotted name: the
# longest listed prefix wins ("gangrun.launch" covers every module under launch/).
API, LIFECYCLE, LAUNCH, RANK, PLATFORM = 4, 3, 2, 1, 0
LAYERS: dict[str, int] = {
    "gangrun": API,  # the package's __init__: re-exports the API
    "gangrun.__main__": API,
    "gangrun.api": API,
    "gangrun.defaults": API,
    "gangrun.plain": API,  # a plain call of a decorated function: a world of one
    "gangrun.cli": API,
    "gangrun.cli_options": API,
    "gangrun.cli_support": API,
    "gangrun.cli_node": API,  # gangrun ps/logs/stacks/stop
    "gangrun.cli_status": API,  # gangrun run's status line
    "gangrun.compat": API,
    "gangrun.interactive": API,  # Gang: a long-lived call over the public API
    "gangrun.notebook": API,  # the notebook panel, output routing, pre-launch checks
    "gangrun.notebook.source": PLATFORM,  # travels with the payload; read inside ranks
    "gangrun.notebook.html": PLATFORM,  # pure rendering (errors render themselves with it)
    "gangrun.notebook.state": PLATFORM,  # the panel's snapshot records
    "gangrun.notebook.charts": PLATFORM,  # the chart grid (pure rendering)
    "gangrun.lifecycle": LIFECYCLE,
    "gangrun.launch": LAUNCH,
    # the rank side: runs inside rank processes (the fork server's child becomes a rank)
    "gangrun.worker": RANK,
    "gangrun.hang": RANK,
    "gangrun.progress": RANK,  # step reports (written by ranks, read by the caller)
    "gangrun.stacks": RANK,  # stack dumps on SIGUSR1 (installed in every rank)
    "gangrun.progress_view": PLATFORM,  # progress records and their formatting
    "gangrun.tracking.rank": RANK,  # ends the MLflow runs a rank opened
    "gangrun.interactive.rank": RANK,  # a gang's rank loop
    "gangrun.interactive.protocol": PLATFORM,  # framing shared by both ends
    # platform-level helpers, usable from every layer and inside ranks
    "gangrun.records": PLATFORM,
    "gangrun.rundir": PLATFORM,
    "gangrun.contract": PLATFORM,
    "gangrun.platform": PLATFORM,
    "gangrun.version": PLATFORM,
    "gangrun.exitcodes": PLATFORM,
    "gangrun.diskspace": PLATFORM,  # a full disk said as such (rank side too)
    "gangrun.options": PLATFORM,  # the typed settings record every layer reads
    "gangrun._log": PLATFORM,
    "gangrun._compat_imports": PLATFORM,
    "gangrun.errors": PLATFORM,
    "gangrun.serialization": PLATFORM,
    "gangrun.security": PLATFORM,
    "gangrun.output": PLATFORM,
    "gangrun.accelerators": PLATFORM,
    "gangrun.reservation": PLATFORM,
    "gangrun.tracking": PLATFORM,
    "gangrun.data": PLATFORM,  # user-facing inside ranks: helpers only
    "gangrun.checkpoint": PLATFORM,
    "gangrun.checkpoint.manager": RANK,  # gangrun.Checkpointer (inside ranks)
    "gangrun.checkpoint.stop": RANK,  # a rank's preemption flag and SIGTERM handler
}
# Modules that run inside a rank: may import only these layers.
RANK_SIDE_MAY_IMPORT = {RANK, PLATFORM}
RANK_SIDE = (
    "gangrun.worker",
    "gangrun.hang",
    "gangrun.progress",
    "gangrun.stacks",
    "gangrun.records",
    "gangrun.rundir",
    "gangrun.tracking.rank",
    "gangrun.interactive.rank",
    "gangrun.checkpoint.manager",
    "gangrun.checkpoint.stop",
)


def _modules() -> dict[str, Path]:
    out = {}
    for p in sorted((SRC / "gangrun").rglob("*.py")):
        parts = list(p.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = p
    return out


MODULES = _modules()


def _imports(mod: str, path: Path) -> set[str]:
    """Every gangrun module ``mod`` imports (``from . import x`` resolves to the module
    ``x`` when it is one, else to the package)."""
    pkg = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "gangrun")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = pkg.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1])
                target = f"{base}.{node.module}" if node.module else base
            elif node.module and node.module.split(".")[0] == "gangrun":
                target = node.module
            else:
                continue
            for a in node.names:
                sub = f"{target}.{a.name}"
                found.add(sub if sub in MODULES else target)
    while True:  # a name that is not a module (a package attribute): its package
        bad = {m for m in found if m not in MODULES}
        if not bad:
            return found - {mod}
        found = (found - bad) | {m.rsplit(".", 1)[0] for m in bad}


def layer(mod: str) -> int:
    best = max((p for p in LAYERS if mod == p or mod.startswith(p + ".")), key=len, default=None)
    assert best is not None, f"{mod} is in no layer: add it to LAYERS in {__file__}"
    return LAYERS[best]


GRAPH = {m: _imports(m, p) for m, p in MODULES.items()}


def test_every_module_has_a_layer():
    for mod in MODULES:
        layer(mod)


def test_no_upward_import():
    bad = [
        f"{m} (layer {layer(m)}) imports {d} (layer {layer(d)})"
        for m, deps in GRAPH.items()
        for d in sorted(deps)
        if layer(d) > layer(m) and not (d != "gangrun" and m.startswith(d + "."))
    ]
    assert not bad, "upward imports:\n" + "\n".join(bad)


def test_rank_side_imports_nothing_caller_side():
    bad = [
        f"{m} imports {d}"
        for m in MODULES
        if m in RANK_SIDE
        for d in sorted(GRAPH[m])
        if layer(d) not in RANK_SIDE_MAY_IMPORT
    ]
    assert not bad, "the rank side imports caller-side code:\n" + "\n".join(bad)


def test_no_import_cycle():
    # A package's __init__ importing its own submodules (re-exports) and the submodules
    # importing the package's shared types is one unit, not a cycle between modules.
    def edges(m: str) -> set[str]:
        return {d for d in GRAPH[m] if not (d.startswith(m + ".") or m.startswith(d + "."))}

    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(edges(m)):
            if state.get(d) == 1:
                cycle = stack[stack.index(d) :] + [d]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(MODULES):
        if m not in state:
            visit(m)


def test_the_checker_sees_imports_inside_functions(tmp_path):
    path = tmp_path / "x.py"
    path.write_text("def f():\n    from ..api import distributed\n    import gangrun.cli\n")
    assert _imports("gangrun.lifecycle.x", path) == {"gangrun.api", "gangrun.cli"}
    assert layer("gangrun.lifecycle.x") < layer("gangrun.api")
