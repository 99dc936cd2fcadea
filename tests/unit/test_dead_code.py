"""No dead code in the package: ``vulture --min-confidence 80`` over ``src/gangrun`` finds
nothing (issue 30, item 6). A name only a protocol uses (IPython's ``_repr_pretty_(p, cycle)``)
is prefixed with ``_``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "gangrun"


def test_vulture_finds_no_dead_code():
    out = subprocess.run(
        [sys.executable, "-m", "vulture", str(SRC), "--min-confidence", "80"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
