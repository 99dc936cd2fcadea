"""A real Jupyter kernel driven through jupyter_client, keeping every iopub message."""

from __future__ import annotations

import contextlib
import os
import queue
import time
from collections.abc import Iterator
from typing import Any

import psutil
from jupyter_client.manager import KernelManager


class Kernel:
    def __init__(self, env: dict[str, str], cwd: str) -> None:
        self.km = KernelManager(kernel_name="python3")
        self.km.start_kernel(env=env, cwd=cwd)
        self.kc = self.km.blocking_client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=60)
        self.msgs: list[dict[str, Any]] = []  # every iopub message, in arrival order
        self.pid = int(self.km.provisioner.process.pid)
        self.tracking_uri = env.get("MLFLOW_TRACKING_URI", "")

    # -- messages --------------------------------------------------------------------------
    def pump(self, timeout: float = 0.1) -> None:
        """Collect the iopub messages that arrive within ``timeout``."""
        end = time.monotonic() + timeout
        while True:
            left = end - time.monotonic()
            try:
                msg = self.kc.get_iopub_msg(timeout=max(0.01, left))
            except queue.Empty:
                return
            self.msgs.append(msg)
            if left <= 0:
                return

    def idle(self, msg_id: str) -> bool:
        return any(
            m["msg_type"] == "status"
            and m["parent_header"].get("msg_id") == msg_id
            and m["content"]["execution_state"] == "idle"
            for m in self.msgs
        )

    def execute(self, code: str, wait: bool = True, timeout: float = 120.0) -> str:
        msg_id = self.kc.execute(code)
        if wait:
            self.wait_idle(msg_id, timeout)
        return msg_id

    def wait_idle(self, msg_id: str, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while not self.idle(msg_id):
            assert time.monotonic() < deadline, f"cell {msg_id} still busy after {timeout}s"
            self.pump(0.2)

    def of(self, msg_id: str, *types: str) -> list[dict[str, Any]]:
        return [
            m
            for m in self.msgs
            if m["parent_header"].get("msg_id") == msg_id and (not types or m["msg_type"] in types)
        ]

    def stream(self, msg_id: str) -> str:
        return "".join(m["content"]["text"] for m in self.of(msg_id, "stream"))

    def error(self, msg_id: str) -> dict[str, Any] | None:
        errs = self.of(msg_id, "error")
        return errs[0]["content"] if errs else None

    # -- teardown ---------------------------------------------------------------------------
    def descendants(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def shutdown(self) -> list[str]:
        """Stop the kernel; return what of its process tree survived (killed then)."""
        procs = self.descendants()
        try:
            procs.append(psutil.Process(self.pid))
        except psutil.NoSuchProcess:
            pass
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=False)
        _, alive = psutil.wait_procs(procs, timeout=15)
        left = [f"{p.pid} {' '.join(p.cmdline())[:100]}" for p in alive if _running(p)]
        for p in alive:
            try:
                p.kill()
            except psutil.Error:
                pass
        return left


def _running(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def kernel_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("PYTEST_CURRENT_TEST", None)
    env.update(extra)
    return env


@contextlib.contextmanager
def open_kernel(home: str, store: str, setup: str, **env: str) -> Iterator[Kernel]:
    """A kernel in ``home`` (its ``HOME`` and working directory) with an MLflow store of its
    own under ``store`` (``kernel.tracking_uri``), after running ``setup``; shut down at the
    end, asserting that nothing of its process tree survived."""
    uri = f"sqlite:///{store}/mlflow.db"
    k = Kernel(kernel_env(MLFLOW_TRACKING_URI=uri, HOME=str(home), **env), str(home))
    try:
        k.execute(setup)
        yield k
    finally:
        left = k.shutdown()
        assert not left, f"processes of the kernel survived its shutdown: {left}"
