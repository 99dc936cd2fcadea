"""Helpers shared by the benchmark scripts: timing, interleaved repetitions, medians and
ratios, JSON output, a loopback S3 server (moto) and a real Jupyter kernel to time cells in."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
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


def interleaved(
    reps: int, methods: Mapping[str, Callable[[], float]], pause: float = 0.2
) -> dict[str, list[float]]:
    """``reps`` rounds of every method in turn (machine noise hits all of them alike); each
    returns the seconds it measured. ``pause`` between methods: a user does not relaunch
    within microseconds."""
    times: dict[str, list[float]] = {k: [] for k in methods}
    for _ in range(reps):
        for name, fn in methods.items():
            times[name].append(fn())
            time.sleep(pause)
    return times


def both_orders(
    n: int, a_then_b: Callable[[], tuple[float, float]], b_then_a: Callable[[], tuple[float, float]]
) -> tuple[list[float], list[float]]:
    """``n`` pairs of timings of two variants, in alternating order so that neither variant
    always goes first; ``a_then_b`` returns (a, b), ``b_then_a`` returns (b, a)."""
    a: list[float] = []
    b: list[float] = []
    for i in range(n):
        if i % 2:
            y, x = b_then_a()
        else:
            x, y = a_then_b()
        a.append(x)
        b.append(y)
    return a, b


def report(
    name: str, times: Mapping[str, list[float]], ratios: Mapping[str, tuple[str, str]]
) -> dict[str, Any]:
    """The result of a benchmark: a summary per series and ``ratios`` (name -> the medians
    of (numerator, denominator) series)."""
    med = {k: summary(v) for k, v in times.items()}
    m = {k: v["median"] for k, v in med.items()}
    return {
        "name": name,
        "unit": "s",
        "results": med,
        "ratios": {k: ratio(m[a], m[b]) for k, (a, b) in ratios.items()},
    }


def elastic_config(nproc: int = 2) -> Any:
    """torchrun's engine configured as the baselines use it: one node, ``nproc`` workers, a
    fresh c10d rendezvous on a free loopback port, no restarts."""
    import uuid

    from torch.distributed.launcher.api import LaunchConfig

    return LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=uuid.uuid4().hex,
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{free_port()}",
        max_restarts=0,
        monitor_interval=0.1,
    )


def start_moto(port: int) -> subprocess.Popen:
    """A moto S3 server on 127.0.0.1:``port`` in its own process (it exits with its parent:
    it reads its stdin until EOF)."""
    code = (
        "from moto.server import ThreadedMotoServer; "
        f"s = ThreadedMotoServer(ip_address='127.0.0.1', port={port}, verbose=False); s.start(); "
        "print('ready', flush=True); import sys; sys.stdin.read()"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert proc.stdout is not None
    if "ready" not in proc.stdout.readline():
        proc.kill()
        raise RuntimeError("moto server did not start")
    return proc


@contextlib.contextmanager
def kernel(env: Mapping[str, str], cwd: str) -> Iterator[Any]:
    """A real Jupyter kernel (jupyter_client) started with ``env`` in ``cwd``; yields its
    blocking client, for `execute_timed`. Shut down at the end."""
    from jupyter_client.manager import KernelManager

    km = KernelManager(kernel_name="python3")
    km.start_kernel(env=dict(env), cwd=cwd)
    kc = km.blocking_client()
    kc.start_channels()
    try:
        kc.wait_for_ready(timeout=60)
        yield kc
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=False)


def execute_timed(kc: Any, code: str, timeout: float = 300.0) -> list[float]:
    """Run a cell; the numbers it printed on lines ``T <seconds>``, in order. A cell error
    raises ``RuntimeError``; a cell still busy after ``timeout`` raises ``TimeoutError``."""
    msg_id = kc.execute(code)
    out: list[float] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            msg = kc.get_iopub_msg(timeout=1)
        except queue.Empty:
            continue
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        c = msg["content"]
        if msg["msg_type"] == "stream":
            out += [float(line.split()[1]) for line in c["text"].splitlines() if line[:2] == "T "]
        elif msg["msg_type"] == "error":
            raise RuntimeError(f"{c['ename']}: {c['evalue']}")
        elif msg["msg_type"] == "status" and c["execution_state"] == "idle":
            return out
    raise TimeoutError(code)


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
