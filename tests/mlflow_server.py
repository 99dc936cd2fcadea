"""A real ``mlflow server`` on a free loopback port that a test can kill (tracking outages).

``MlflowServer(dir).start()`` waits (bounded) until ``/health`` answers; ``kill()`` SIGKILLs
its whole process group at once (the outage); ``stop()`` (teardown) ends it and asserts that
none of its processes survived.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class MlflowServer:
    def __init__(self, directory: Path, ready_within: float = 150.0) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.ready_within = ready_within  # a loaded 2-core machine: ~60 s seen
        self.proc: subprocess.Popen | None = None
        self._tree: list[int] = []

    def start(self) -> MlflowServer:
        d = self.dir
        env = dict(os.environ, HOME=str(d), MLFLOW_DISABLE_TELEMETRY="true")
        env.pop("MLFLOW_TRACKING_URI", None)
        cmd = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1"]
        cmd += ["--port", str(self.port), "--workers", "1"]
        cmd += ["--backend-store-uri", f"sqlite:///{d}/server.db"]
        cmd += ["--artifacts-destination", str(d / "artifacts")]
        with open(d / "server.log", "ab") as log:  # the server holds its own copy
            self.proc = subprocess.Popen(
                cmd, cwd=d, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + self.ready_within
        while True:
            if self.proc.poll() is not None:
                raise AssertionError((d / "server.log").read_text()[-3000:])
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise AssertionError(f"mlflow server not ready within {self.ready_within:g} s")
            time.sleep(0.25)
        try:
            self._tree = [self.proc.pid] + [
                c.pid for c in psutil.Process(self.proc.pid).children(recursive=True)
            ]
        except psutil.Error:
            self._tree = [self.proc.pid]
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """The outage: every process of the server SIGKILLed at once; its port refuses."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(10)
        self._wait_tree_gone(10.0)

    def _wait_tree_gone(self, wait: float) -> list[int]:
        deadline = time.monotonic() + wait
        alive = list(self._tree)
        while alive and time.monotonic() < deadline:
            for p in list(alive):
                try:
                    if psutil.Process(p).status() == psutil.STATUS_ZOMBIE:
                        alive.remove(p)
                except psutil.Error:
                    alive.remove(p)
            time.sleep(0.05)
        return alive

    def stop(self) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(5)
        except (OSError, subprocess.TimeoutExpired):
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(10)
        alive = self._wait_tree_gone(10.0)
        for p in alive:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc = None
        assert not alive, f"mlflow server processes survived: {alive}"
