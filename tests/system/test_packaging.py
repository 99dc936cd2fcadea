"""Packaging and documentation, as CI checks them: the wheel installs into a fresh venv and
its ``gangrun`` command works there; the docs build with warnings as errors."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import gangrun

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def _clean_env(**extra: str) -> dict[str, str]:
    """The environment without this checkout on the path (the wheel must stand alone)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # would make setuptools print warnings
    env.update(extra)
    return env


def _run(cmd: list[str], timeout: float, **kw) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    assert proc.returncode == 0, f"{cmd} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc


def test_wheel_installs_into_a_fresh_venv(tmp_path):
    dist = tmp_path / "dist"
    build = _run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(dist), str(ROOT)],
        timeout=180,
        env=_clean_env(),
        cwd=str(tmp_path),
    )
    log = build.stdout + build.stderr
    warnings = [line for line in log.splitlines() if "warning" in line.lower()]
    assert not warnings, warnings
    version = gangrun.__version__
    wheel = dist / f"gangrun-{version}-py3-none-any.whl"
    assert wheel.exists() and (dist / f"gangrun-{version}.tar.gz").exists()

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], timeout=120)  # plain: no site-packages
    py = venv / "bin" / "python"
    env = _clean_env(PIP_DISABLE_PIP_VERSION_CHECK="1")
    _run(
        [str(py), "-m", "pip", "install", "-q", "--no-deps", str(wheel), "cloudpickle", "psutil"],
        timeout=300,
        env=env,
        cwd=str(tmp_path),
    )
    where = _run(
        [str(py), "-c", "import gangrun, sys; print(gangrun.__file__); print(sorted(sys.modules))"],
        timeout=60,
        env=env,
        cwd=str(tmp_path),
    ).stdout.splitlines()
    assert where[0].startswith(str(venv)), where[0]  # the installed copy, not this checkout
    assert "torch" not in where[1] and "mlflow" not in where[1]

    gangrun_cmd = str(venv / "bin" / "gangrun")
    out = _run([gangrun_cmd, "--version"], timeout=60, env=env, cwd=str(tmp_path)).stdout
    assert out.strip() == f"gangrun {version}"
    info = _run([gangrun_cmd, "info"], timeout=120, env=env, cwd=str(tmp_path)).stdout
    assert f"gangrun {version}" in info
    assert "libraries: torch -, mlflow -" in info  # a bare install: no extras
    assert "timeout" in info and "built-in" in info  # the effective defaults


def test_docs_build_strict(tmp_path):
    site = tmp_path / "site"
    proc = _run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        timeout=300,
        cwd=str(ROOT),
        env=_clean_env(NO_MKDOCS_2_WARNING="1"),
    )
    assert "WARNING" not in proc.stderr, proc.stderr
    api = (site / "reference" / "api" / "index.html").read_text()
    assert "set_defaults" in api and "DistributedFunction" in api
    for page in ("errors", "data", "checkpoint", "compat", "cli"):
        assert (site / "reference" / page / "index.html").exists()
    for page in (site / "reference").rglob("index.html"):  # no Sphinx role shown as text
        html = page.read_text()
        assert not re.search(r":(class|func|meth|mod|attr|exc|data|obj):<code>", html), page
    assert 'href="../errors/#gangrun.errors.LaunchError"' in api  # a rendered cross-reference
