"""The Ray actor that runs one rank on its node (methods run in threads, max_concurrency>1).

The rank is a fresh interpreter (``gangrun.rank.boot``) in its own process group,
holding a liveness pipe whose write end lives in the actor: when the actor dies (``ray.kill``,
the caller's driver exits, the node is lost) the rank kills its own tree.

The caller beats (`RankActor.beat`, about once a second, through its Ray connection); an actor
that hears nothing for ``caller_deadline`` seconds ends its rank and itself, so a dead
caller leaves no rank running on the cluster.
A caller's death reaches the actors through its driver only when the caller *is* the driver:
under Ray Client (``ray://``) the driver is a process on the head that Ray keeps ~30 s after
its client vanished (the client's reconnect grace), and the actors with it.

Its private directory on the node (payload, context, result/error) never outlives it (the
payload may hold secrets, and the node's disk is not ours to fill): a tiny janitor process, detached from the actor, removes the directory
as soon as the actor is gone, however it went (Ray kills an exiting worker's children, so the
janitor double-forks away from it); and every actor, when it starts, removes the directories
of actors on its node that are gone (each directory names its actor by pid and start ticks).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import IO

from ...host import system as platform
from ...wire import contract
from ...wire.rundir import CONTEXT, PAYLOAD, RunDir
from .records import ActorContext, NodeInfo, Polled, RankOutputs, Started
from .ship import caller_paths_only, remote_paths, sees_caller_files
from .versions import local_versions

log = logging.getLogger("gangrun.launch.ray")
OWNER = "actor"  # file in an actor's directory: "pid:start-ticks" of the actor process
PREFIX = "gangrun-ray-"
# Waits for EOF on fd argv[2] (the actor's end closes when the actor is gone), then removes
# directory argv[1]. Double-forks first: Ray kills the children of a worker that exits.
_JANITOR = (
    "import os, shutil, sys\n"
    "if os.fork(): os._exit(0)\n"
    "os.setsid()\n"
    "fd = int(sys.argv[2])\n"
    "try:\n"
    "    while os.read(fd, 64): pass\n"
    "except OSError: pass\n"
    "shutil.rmtree(sys.argv[1], ignore_errors=True)\n"
)


def _exit_status(pid: int) -> int | None:
    """Block until child ``pid`` has ended and return its status as ``Popen.returncode`` has
    it (``-N`` for signal N), leaving it unreaped (``WNOWAIT``); ``None`` if it is no child."""
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
    except ChildProcessError:
        return None
    if info is None:  # pragma: no cover - only with WNOHANG
        return None
    if info.si_code == os.CLD_EXITED:
        return int(info.si_status)
    return -int(info.si_status)  # CLD_KILLED / CLD_DUMPED


def reap_node_leftovers(tmp: str | None = None) -> list[str]:
    """Remove the directories of this user's rank actors on this node that are gone."""
    removed: list[str] = []
    for path in platform.own_dirs(tmp or tempfile.gettempdir(), PREFIX):
        try:
            with open(os.path.join(path, OWNER)) as f:
                owner = f.read().strip()
        except OSError:
            continue  # not one of ours, or being created right now
        pid = int(owner.split(":", 1)[0]) if owner.split(":", 1)[0].isdigit() else 0
        if pid and platform.process_identity(pid) != owner:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    if removed:
        log.info("removed leftover rank directories %s", removed)
    return removed


class RankActor:
    """Runs one rank on its node."""

    def __init__(self, run_id: str, rank: int, caller_deadline: float = 0.0) -> None:
        self.run_id = run_id
        self.rank = rank
        self.proc: subprocess.Popen | None = None
        self.dir = ""
        self._since_ticks = platform.ticks_now()
        self._cv = threading.Condition()
        self._buf: dict[str, list[bytes]] = {"out": [], "err": []}
        self._open = 0
        self._code: int | None = None
        self._exited_at = 0.0
        self._live_w = -1
        self._janitor_w = -1
        self._beat = time.monotonic()
        if caller_deadline > 0:
            threading.Thread(
                target=self._watch_caller, args=(caller_deadline,), daemon=True
            ).start()

    def beat(self) -> None:
        """The caller is alive (its heartbeat)."""
        self._beat = time.monotonic()

    def _watch_caller(self, deadline: float) -> None:
        """End the rank and this actor once the caller has not beaten for ``deadline``
        seconds. A pause of this process itself (a stopped or starved node) restarts the
        count: beats queued meanwhile are not late."""
        step = min(0.5, deadline / 4)
        last = time.monotonic()
        while True:
            time.sleep(step)
            now = time.monotonic()
            if now - last > step + max(1.0, deadline / 2):  # we did not run: not the caller
                self._beat = max(self._beat, now)
            last = now
            if now - self._beat > deadline:
                break
        print(
            f"gangrun: rank {self.rank}'s actor heard nothing from its caller for "
            f"{deadline:g}s ({contract.RAY_CALLER_DEADLINE}): the caller is gone; ending the "
            "rank and this actor.",
            file=sys.stderr,
            flush=True,
        )
        try:
            self.cleanup()
        finally:
            os._exit(1)

    def node_info(self) -> NodeInfo:
        import ray

        from gangrun.host import accelerators

        ctx = ray.get_runtime_context()
        gpu_ids = [str(g) for g in ray.get_gpu_ids()]
        names: list[str] = []
        if gpu_ids:
            try:
                names = [d.name for d in accelerators.detect()]
            except Exception:  # no NVML here: the type check has nothing to compare
                names = []
        return NodeInfo(
            node_id=str(ctx.get_node_id()),
            ip=str(ray.util.get_node_ip_address()),
            hostname=os.uname().nodename,
            gpu_ids=tuple(gpu_ids),
            gpu_names=tuple(names),
            cpus=os.cpu_count() or 1,
            pid=os.getpid(),
            cwd=os.getcwd(),
            versions=local_versions(),
        )

    def free_port(self) -> int:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("0.0.0.0", 0))
            return int(s.getsockname()[1])

    def _make_dir(self) -> RunDir:
        reap_node_leftovers()
        self.dir = tempfile.mkdtemp(prefix=f"{PREFIX}{self.run_id}-r{self.rank}-")
        with open(os.path.join(self.dir, OWNER), "w") as f:
            f.write(platform.process_identity(os.getpid()) or "")
        jr, self._janitor_w = os.pipe()
        try:
            janitor = subprocess.Popen(
                [sys.executable, "-S", "-c", _JANITOR, self.dir, str(jr)],
                pass_fds=(jr,),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
            )
            janitor.wait(30)  # the first fork returns at once; the janitor lives on detached
        finally:
            os.close(jr)
        return RunDir(self.dir)

    def start(self, payload: bytes, context: ActorContext, env: dict[str, str]) -> Started:
        """Start the rank (``local``: this node sees the caller's files, and the rank runs in
        the caller's very directory)."""
        from ..spawn import boot_command

        rd = self._make_dir()
        with open(rd.payload, "wb") as f:
            f.write(payload)
        ctx = context.rank
        caller_path = list(ctx.sys_path)
        cwd = ctx.cwd
        local = sees_caller_files(context.caller_files, cwd)
        if local:  # the caller's paths first, then this node's own (without shipped copies)
            own = caller_paths_only(context.ship, sys.path)
            sys_path = caller_path + [p for p in own if p not in caller_path]
        else:
            shipped_cwd, sys_path = remote_paths(context.ship, caller_path, sys.path)
            if shipped_cwd:
                cwd = shipped_cwd
        if (context.use_actor_cwd and not local) or not os.path.isdir(cwd):
            cwd = os.getcwd()
        with open(rd.context, "w") as f:
            f.write(dataclasses.replace(ctx, sys_path=sys_path, cwd=cwd).to_json())
        full = dict(os.environ)
        full.update(env)
        full[contract.RUN_DIR] = self.dir
        live_r, self._live_w = os.pipe()
        full[contract.LIVENESS_FD] = str(live_r)
        # Ray's worker threads block signals (its main thread handles them), and a child
        # inherits the mask of the thread that forks it: start the rank with none blocked,
        # or it never sees SIGINT (interrupt), SIGUSR1 (stacks) or SIGTERM (grace).
        mask = signal.pthread_sigmask(signal.SIG_SETMASK, set())
        try:
            self.proc = subprocess.Popen(
                boot_command(),
                env=full,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                pass_fds=(live_r,),
                start_new_session=True,
            )
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
            os.close(live_r)
        assert self.proc.stdout is not None and self.proc.stderr is not None
        self._open = 2
        for kind, pipe in (("out", self.proc.stdout), ("err", self.proc.stderr)):
            threading.Thread(target=self._read, args=(kind, pipe), daemon=True).start()
        threading.Thread(target=self._wait, daemon=True).start()
        return Started(pid=int(self.proc.pid), local=local, cwd=cwd)

    def _read(self, kind: str, pipe: IO[bytes]) -> None:
        fd = pipe.fileno()
        while True:
            try:
                data = os.read(fd, 1 << 16)
            except OSError:
                data = b""
            with self._cv:
                if not data:
                    self._open -= 1
                    self._cv.notify_all()
                    break
                self._buf[kind].append(data)
                self._cv.notify_all()
        pipe.close()

    def _wait(self) -> None:
        """Report the rank's exit as soon as it is a zombie, then reap it. The reap
        (``release_task``) drops the zombie's ``/proc`` dentries, and on Linux 6.x that waits,
        spinning in ``shrink_dcache_parent``, for the rank's other threads still flushing
        theirs: seconds of kernel time on a loaded node (measured: 1-13 s per rank on 2
        cores), during which a plain ``wait()`` would not have said the rank ended."""
        assert self.proc is not None
        code = _exit_status(self.proc.pid)
        if code is None:  # not ours to wait for (reaped elsewhere): the Popen's own answer
            code = self.proc.wait()
        with self._cv:
            self._code = code
            self._exited_at = time.monotonic()
            self._cv.notify_all()
        self.proc.wait()  # the reap, after the exit was reported

    def _exit_ready(self) -> bool:
        # Report the exit once the rank's output is drained (or after a second, when a
        # descendant that outlives the rank still holds its pipes).
        return self._code is not None and (
            self._open == 0 or time.monotonic() - self._exited_at > 1.0
        )

    def poll(self, timeout: float) -> Polled:
        """New output since the last poll and, once it ended and was drained, the exit code."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while not (self._buf["out"] or self._buf["err"] or self._exit_ready()):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cv.wait(min(left, 0.25) if self._code is not None else left)
            out = b"".join(self._buf["out"])
            err = b"".join(self._buf["err"])
            self._buf = {"out": [], "err": []}
            done = self._exit_ready() and not out and not err
            return Polled(out, err, self._code if done else None)

    def files(self) -> RankOutputs:
        """The rank's result/error file (whichever it wrote), and its step report."""
        rd = RunDir(self.dir)

        def read(path: str) -> bytes | None:
            try:
                with open(path, "rb") as f:
                    return f.read()
            except OSError:
                return None  # the rank wrote the other one (or neither)

        return RankOutputs(
            result=read(rd.result(self.rank)),
            error=read(rd.error(self.rank)),
            progress=read(rd.progress(self.rank)),  # the caller's restart rules read it
        )

    def signal(self, sig: int) -> None:
        """Signal the rank's tree; with SIGKILL also sweep this node for the run's processes."""
        p = self.proc
        if p is not None:
            platform.signal_tree([p.pid], sig)
        if sig == signal.SIGKILL:
            platform.sweep(self.run_id, self._since_ticks)

    def cleanup(self) -> None:
        """The gang is done: nothing of the rank is left, its directory is removed."""
        p = self.proc
        # a rank whose exit was reported is dead (its reap may still be running in `_wait`)
        if p is not None and self._code is None and p.poll() is None:
            platform.signal_tree([p.pid], signal.SIGKILL)
            try:
                p.wait(5.0)
            except subprocess.TimeoutExpired:  # pragma: no cover - unkillable (D state)
                log.warning("rank %d (pid %d) did not die", self.rank, p.pid)
        platform.sweep(self.run_id, self._since_ticks)
        with self._cv:  # the caller's cleanup and the caller watch's: each fd closed once
            for name in ("_live_w", "_janitor_w"):
                fd = getattr(self, name)
                if fd != -1:
                    setattr(self, name, -1)
                    os.close(fd)
        if self.dir:
            shutil.rmtree(self.dir, ignore_errors=True)


__all__ = ["RankActor", "reap_node_leftovers", "PAYLOAD", "CONTEXT"]
