"""Helpers shared by the benchmark scripts (timing, medians, JSON output)."""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

BENCH = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH)
SRC = os.path.join(ROOT, "src")
for p in (SRC, BENCH):
    if p not in sys.path:
        sys.path.insert(0, p)
os.environ["PYTHONPATH"] = os.pathsep.join(
    [SRC, BENCH] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])
)
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def median(xs: list[float]) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


def summary(xs: list[float]) -> dict[str, Any]:
    return {
        "median": median(xs),
        "min": min(xs) if xs else None,
        "max": max(xs) if xs else None,
        "n": len(xs),
        "samples": [round(x, 6) for x in xs],
    }


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def main(run: Callable[[int], dict[str, Any]], default_reps: int = 5) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=default_reps)
    ap.add_argument("--out", default=None, help="write the JSON result here")
    a = ap.parse_args()
    res = run(max(1, a.reps))
    text = json.dumps(res, indent=2)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    print(text, flush=True)
