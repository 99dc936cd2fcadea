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
import urllib.error
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


class BasicAuthProxy:
    """A real HTTP proxy on a free loopback port that requires HTTP basic authentication
    (``user``/``password``) and forwards every authenticated request to ``target`` (the
    ``mlflow server``'s URL): a tracking server behind an auth layer, as in production.
    A request without the right credentials is answered 401 and counted in ``rejected``;
    ``served`` counts the forwarded ones. Runs in a daemon thread of the test process;
    ``stop()`` closes it."""

    def __init__(self, target: str, user: str, password: str) -> None:
        import base64
        import http.server
        import threading

        self.target = target.rstrip("/")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.served = 0
        self.seen: list[str] = []  # "METHOD path" of every request, in order
        self.rejected: list[str] = []  # "METHOD path" of each refused request
        expected = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass  # quiet

            def _forward(self) -> None:
                proxy.seen.append(f"{self.command} {self.path}")
                body = self._body()
                if self.headers.get("Authorization") != expected:
                    proxy.rejected.append(f"{self.command} {self.path}")
                    self.close_connection = True
                    self._answer(401, {"WWW-Authenticate": 'Basic realm="mlflow"'}, b"")
                    return
                headers = {
                    k: v
                    for k, v in self.headers.items()
                    if k.lower()
                    not in (
                        "host",
                        "authorization",
                        "connection",
                        "content-length",
                        "transfer-encoding",
                    )
                }
                req = urllib.request.Request(
                    proxy.target + self.path, data=body, headers=headers, method=self.command
                )
                try:
                    with urllib.request.urlopen(req, timeout=60) as r:  # noqa: S310
                        status, got, data = r.status, dict(r.headers.items()), r.read()
                except urllib.error.HTTPError as exc:
                    status, got, data = exc.code, dict(exc.headers.items()), exc.read()
                proxy.served += 1
                keep = {k: v for k, v in got.items() if k.lower() == "content-type"}
                self._answer(status, keep, data)

            def _body(self) -> bytes | None:
                """The request's body, whole (a chunked one too)."""
                if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
                    parts = []
                    while True:
                        size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                        if size == 0:
                            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                                pass  # trailers
                            return b"".join(parts)
                        parts.append(self.rfile.read(size))
                        self.rfile.readline()  # the chunk's CRLF
                length = int(self.headers.get("Content-Length") or 0)
                return self.rfile.read(length) if length else None

            def _answer(self, status: int, headers: dict[str, str], data: bytes) -> None:
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _forward

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="basic-auth-proxy", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(10)
