"""`make demo` installs what the demo needs, not the development toolchain (requirements-dev
.txt: some 480 packages with Ray, DeepSpeed, moto, MkDocs, ...).

The demo's set is requirements-demo.txt (the torch pin, MLflow, gangrun's own dependencies);
requirements-dev.txt includes it, so `make test` keeps one torch pin and installs everything."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DEMO = {"torch", "mlflow", "cloudpickle", "psutil"}
TOOLCHAIN = {"ray", "deepspeed", "moto", "mkdocs", "pytest", "ruff", "mypy", "accelerate"}


def _requirements(path: Path) -> dict[str, str]:
    """Package name -> its requirement line, following ``-r`` includes."""
    out: dict[str, str] = {}
    for raw in path.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        if line.startswith("-r "):
            out.update(_requirements(path.parent / line[3:].strip()))
            continue
        name = re.match(r"[A-Za-z0-9_.-]+", line)
        assert name, f"{path.name}: cannot read {raw!r}"
        out[name.group(0).lower()] = line
    return out


def test_the_demo_requirements_are_a_small_set():
    demo = _requirements(ROOT / "requirements-demo.txt")
    assert set(demo) == DEMO
    assert demo["torch"] == "torch==2.13.0"  # the CPU pin of this machine's local wheel
    dev = _requirements(ROOT / "requirements-dev.txt")
    assert set(dev) >= TOOLCHAIN  # `make test` still gets the whole toolchain ...
    assert all(dev[name] == line for name, line in demo.items())  # ... with the demo's pins


def test_the_demo_imports_only_what_its_requirements_install():
    tree = ast.parse((ROOT / "examples" / "mlp_ddp.py").read_text())
    tops = set()
    for node in ast.walk(tree):  # also the imports inside functions
        if isinstance(node, ast.Import):
            tops |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            tops.add(node.module.split(".")[0])
    assert {"torch", "mlflow", "gangrun"} <= tops
    outside = tops - set(sys.stdlib_module_names) - {"gangrun", "__future__"} - DEMO
    assert not outside, f"examples/mlp_ddp.py imports {sorted(outside)}, not in the demo's set"


def _dry_run(target: str, venv: Path) -> list[str]:
    proc = subprocess.run(
        ["make", "-n", "-C", str(ROOT), target, f"VENV={venv}"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    return [line for line in proc.stdout.splitlines() if "pip install" in line]


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_demo_installs_the_demo_set_and_make_test_the_dev_set(tmp_path):
    venv = tmp_path / "venv"  # a fresh venv: make would install everything it needs
    demo = _dry_run("demo", venv)
    assert any("-r requirements-demo.txt" in line for line in demo), demo
    assert not any("requirements-dev.txt" in line for line in demo), demo
    assert any("--no-deps -e ." in line for line in demo), demo  # gangrun itself, no deps
    test = _dry_run("test", venv)
    assert any("-r requirements-dev.txt" in line for line in test), test
