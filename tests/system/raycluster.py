"""A real two-raylet Ray cluster on loopback whose second node does not see the caller's files.

The head is ``ray start --head`` on 127.0.0.1; the second raylet is ``ray start --address=...``
inside ``unshare --mount --propagation private`` with a tmpfs mounted over ``hidden`` first
(we run as root), so on that node the caller's project directory exists but is empty, as on a
real cluster node. Each raylet has one CPU: two CPU ranks land one per node. Every process of
the cluster is found by its temp dir (and descendants) and killed at the end; ``ray stop`` is
never used (it would stop other people's clusters on this machine).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

import psutil

MB = 1 << 20
BIN = os.path.dirname(sys.executable)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class TwoRaylets:
    def __init__(self, temp: str, hidden: str) -> None:
        self.temp = temp
        self.hidden = hidden
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.client_port = free_port()  # Ray Client's server on the head
        self.client_address = f"ray://127.0.0.1:{self.client_port}"
        # A private HOME: Ray reads (and other clusters on this machine may write)
        # ~/.ray/auth_token; a token of someone else's cluster must not reach this one.
        home = os.path.join(temp, "home")
        os.makedirs(home, exist_ok=True)
        self.env = dict(os.environ, RAY_TMPDIR=temp, RAY_USAGE_STATS_ENABLED="0", HOME=home)
        self.env["PATH"] = BIN + os.pathsep + self.env.get("PATH", "")

    def _ray_start(self, argv: list[str], wrap: list[str] | None = None) -> None:
        cmd = [os.path.join(BIN, "ray"), "start", *argv]
        common = [
            "--node-ip-address=127.0.0.1",
            "--num-cpus=1",
            f"--object-store-memory={80 * MB}",
            "--disable-usage-stats",
            f"--dashboard-agent-listen-port={free_port()}",
            f"--metrics-export-port={free_port()}",
        ]
        full = (wrap or []) + cmd + common
        out = subprocess.run(full, env=self.env, capture_output=True, text=True, timeout=120)
        if out.returncode != 0:
            raise RuntimeError(f"{' '.join(full)} failed:\n{out.stdout}\n{out.stderr}")

    def start(self) -> TwoRaylets:
        self._ray_start(
            [
                "--head",
                f"--port={self.port}",
                f"--temp-dir={self.temp}",
                "--include-dashboard=false",
                f"--ray-client-server-port={self.client_port}",
                '--resources={"head_node": 1}',
            ]
        )
        hide = 'mount -t tmpfs -o size=16m tmpfs "$0" && exec "$@"'  # the project is empty there
        self._ray_start(
            [f"--address={self.address}", '--resources={"other_node": 1}'],
            wrap=["unshare", "--mount", "--propagation", "private", "sh", "-c", hide, self.hidden],
        )
        return self

    def processes(self) -> list[psutil.Process]:
        """Every process of the cluster: those naming its temp dir, and their descendants."""
        found: dict[int, psutil.Process] = {}
        for p in psutil.process_iter():
            try:
                if any(self.temp in a for a in p.cmdline()):
                    found[p.pid] = p
                    for c in p.children(recursive=True):
                        found[c.pid] = c
            except psutil.Error:
                continue
        return list(found.values())

    def actors(self, name: str = "RankActor") -> list[int]:
        """Pids of live Ray workers running an actor of class ``name`` (their title)."""
        pids = []
        for p in self.processes():
            try:
                if p.status() != psutil.STATUS_ZOMBIE and f"ray::{name}" in " ".join(p.cmdline()):
                    pids.append(p.pid)
            except psutil.Error:
                continue
        return pids

    def stop(self) -> list[str]:
        """Kill the whole cluster; what survived (should be nothing). SIGTERM first, with 2 s
        to go: the workers, agents and the second raylet end within 0.1 s, but the GCS and the
        autoscaler monitor outlive a SIGTERM by more than 10 s (the head raylet waits for them),
        so a longer grace only waits; SIGKILL then, with 10 s for every process to be gone."""
        procs = self.processes()
        for sig, grace in ((signal.SIGTERM, 2.0), (signal.SIGKILL, 10.0)):
            for p in procs:
                try:
                    p.send_signal(sig)
                except psutil.Error:
                    continue
            deadline = time.monotonic() + grace
            while time.monotonic() < deadline and any(_alive(p) for p in procs):
                time.sleep(0.1)
        return [f"{p.pid} {' '.join(p.cmdline())[:100]}" for p in procs if _alive(p)]


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


@contextlib.contextmanager
def running(hidden: str, **env: str) -> Iterator[TwoRaylets]:
    """A started cluster (``env``: more variables for its processes) that this process is
    connected to; at the end disconnected and killed, and nothing of it may survive."""
    import ray

    c = TwoRaylets(tempfile.mkdtemp(prefix="grray-", dir="/tmp"), hidden)  # short: socket paths
    c.env.update(env)
    try:
        c.start()
        ray.init(address=c.address, log_to_driver=False, logging_level="WARNING")
        yield c
    finally:
        ray.shutdown()
        left = c.stop()
        assert not left, f"processes of the cluster survived: {left}"
