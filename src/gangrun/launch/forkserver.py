"""Ranks forked from a warm helper: fork speed without forking the caller.

The fork server is a helper process started once per caller (lazily, on the first launch). It
imports the heavy modules (``GANGRUN_PRELOAD``, default ``torch``; comma-separated, ``none``
for nothing) and never initialises CUDA, then waits on a private unix socket pair. For each
launch the caller sends the ranks' environments together with the rank's stdout/stderr pipe
ends, the caller's liveness pipe and a per-rank status pipe (``SCM_RIGHTS``); the server forks
one child per rank and answers with the pids. A forked child becomes what a fresh interpreter
would be: its own session and process group, default signal dispositions, only the fds it was
given, the rank's environment (also in ``/proc/PID/environ``, so tools and the run sweep see
it), the caller's ``sys.path``/cwd, fresh random seeds, ``OMP_NUM_THREADS`` applied to torch;
then :func:`gangrun.worker.main` loads the payload (after the fork, so edited code is what runs).

The server is the ranks' parent: it reaps them (``SIGCHLD`` wakes its loop) and writes each
exit status into that rank's status pipe, so the caller sees an exit within a millisecond.
If the caller dies, its ranks see their liveness pipe close (as with spawned ranks) and the
server sees its control socket close and exits. If the server dies, every rank it forked sees
the server's own liveness pipe close and kills its tree; the next launch starts a new server.
When the server cannot be started, the launch falls back to fresh interpreters (``LocalGang``).

Variables that only act at interpreter start-up (``PYTHONHASHSEED``, ``LD_PRELOAD``, OpenMP
affinity, ...) cannot be changed in a forked child: when a gang's value differs from the
server's, the server is restarted with the gang's values first.
"""

from __future__ import annotations

import atexit
import os
import pickle
import queue
import selectors
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from typing import Any

from ..platform import signal_tree as _signal_tree
from ..platform import sweep, ticks_now, wait_gone
from . import GangSpec, RankExit
from .local import _GANGRUN_PARENT, LocalGang, release_gang

PAD_VAR = "GANGRUN_ENVIRON_PAD"
PAD_LEN = 32 * 1024  # bytes reserved in the server's environ block for a rank's environment
DEFAULT_PRELOAD = "torch"
_MSG_MAX = 8 << 20
_SOCK_BUF = 8 << 20
_FDS_PER_RANK = 4
_RANKS_PER_MSG = 48  # SCM_RIGHTS carries at most 253 fds per message
_POOL_MAX = 16  # idle pre-forked children kept at most
_STATUS = struct.Struct("<i")

_BOOT = (
    "import sys; sys.path.insert(0, {path!r}); "
    "from gangrun.launch.forkserver import serve; serve(int(sys.argv[1]))"
)

# Environment variables read only when an interpreter (or a native library it loads at
# import) starts: a forked child cannot change them afterwards.
_STARTUP_EXACT = frozenset(
    {"LD_PRELOAD", "LD_LIBRARY_PATH", "LD_BIND_NOW", "PYTHONHOME", "CUDA_MODULE_LOADING"}
)
_STARTUP_PREFIXES = ("PYTHON", "MALLOC_", "GOMP_", "KMP_", "OMP_", "MKL_", "TORCH_CPP_", "GLIBC_")
_RUNTIME_OK = frozenset(
    {
        "PYTHONPATH",  # the caller's sys.path is applied explicitly
        "PYTHONUNBUFFERED",
        "PYTHONIOENCODING",
        "PYTHONDONTWRITEBYTECODE",
        "PYTHONBREAKPOINT",
        "OMP_NUM_THREADS",  # applied with torch.set_num_threads
        "MKL_NUM_THREADS",
    }
)
# Not inherited by the server from the caller (the server must look like no run's process).
_SERVER_DROP_PREFIXES = ("GANGRUN_",)
_SERVER_DROP = frozenset({"OMP_NUM_THREADS", "MKL_NUM_THREADS"})


def _startup_var(name: str) -> bool:
    if name in _RUNTIME_OK:
        return False
    return name in _STARTUP_EXACT or name.startswith(_STARTUP_PREFIXES)


def startup_signature(env: dict[str, str]) -> tuple[tuple[str, str], ...]:
    """The start-up-only variables of ``env``: a forked rank inherits the server's."""
    return tuple(sorted((k, v) for k, v in env.items() if _startup_var(k)))


def _send(sock: socket.socket, obj: Any, fds: list[int] | tuple[int, ...] = ()) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    if len(data) > _MSG_MAX:
        raise ValueError(f"fork server message too large ({len(data)} bytes)")
    if fds:
        socket.send_fds(sock, [data], list(fds))
    else:
        sock.sendall(data)


def _recv(sock: socket.socket, maxfds: int = 0) -> tuple[Any, list[int]]:
    """One message (and the fds it carries); ``(None, [])`` at EOF."""
    if maxfds:
        data, fds, flags, _ = socket.recv_fds(sock, _MSG_MAX, maxfds)
    else:
        data, fds, flags = sock.recv(_MSG_MAX), [], 0
    if not data:
        for fd in fds:
            os.close(fd)
        return None, []
    if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
        for fd in fds:
            os.close(fd)
        raise OSError("fork server message truncated")
    return pickle.loads(data), list(fds)


# ======================================================================== server side
class _Server:
    """The fork server's state: the control socket, the running children (pid -> status
    pipe) and a small pool of idle pre-forked children, so that a launch needs no fork."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.status: dict[int, int] = {}  # running child pid -> write end of its status pipe
        self.pool: list[tuple[int, socket.socket]] = []  # idle children: pid, assignment socket
        self.pool_target = 0
        self.preloaded: list[str] = []
        self.failed: dict[str, str] = {}
        # Read end inherited by every child: EOF tells the child the server is gone.
        self.alive_r, self.alive_w = os.pipe()
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(self.wake_w, False)
        self.pad_len = len(PAD_VAR) + 1 + len(os.environ.get(PAD_VAR, "")) + 1

    # -- start-up ---------------------------------------------------------------------
    def init(self) -> None:
        msg, _ = _recv(self.sock)
        if msg is None:
            os._exit(0)
        paths = list(msg.get("sys_path") or [])
        if _GANGRUN_PARENT not in paths:
            paths.append(_GANGRUN_PARENT)
        sys.path[:] = paths
        self.pool_target = int(msg.get("pool", 0))
        import importlib

        for name in list(msg.get("preload") or []) + [
            "gangrun.worker",
            "gangrun.serialization",
            "cloudpickle",
            "psutil",
            "faulthandler",
            "ctypes",
            "io",
            "random",
            "json",
            "traceback",
        ]:
            try:
                importlib.import_module(name)
                self.preloaded.append(name)
            except BaseException as exc:  # a broken optional module must not kill the server
                self.failed[name] = f"{type(exc).__name__}: {exc}"
        import gc

        gc.collect()
        gc.freeze()  # keep the preloaded objects' pages shared with the children
        _send(self.sock, {"ok": True, "ready": True, **self.info()})

    def info(self) -> dict[str, Any]:
        torch = sys.modules.get("torch")
        cuda_init = None
        if torch is not None:
            try:
                cuda_init = bool(torch.cuda.is_initialized())
            except Exception:
                cuda_init = None
        return {
            "pid": os.getpid(),
            "preloaded": list(self.preloaded),
            "failed": dict(self.failed),
            "cuda_initialized": cuda_init,
            "threads": len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self") else 0,
            "children": sorted(self.status),
            "pool": [pid for pid, _ in self.pool],
        }

    # -- loop -------------------------------------------------------------------------
    def loop(self) -> None:
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.set_wakeup_fd(self.wake_w, warn_on_full_buffer=False)
        sel = selectors.PollSelector()  # no epoll fd to leak into children
        sel.register(self.sock, selectors.EVENT_READ, "ctl")
        sel.register(self.wake_r, selectors.EVENT_READ, "chld")
        while True:
            # Refill the pool only while no rank runs: forking costs CPU the ranks want.
            timeout = 0.0 if (not self.status and len(self.pool) < self.pool_target) else None
            events = sel.select(timeout)
            for key, _ in events:
                if key.data == "chld":
                    try:
                        while os.read(self.wake_r, 4096):
                            pass
                    except (BlockingIOError, InterruptedError):
                        pass
                    continue
                try:
                    msg, fds = _recv(self.sock, 253)
                except (ConnectionError, OSError):
                    msg, fds = None, []
                if msg is None:
                    # The caller closed the channel (exit or death). Children notice that we
                    # are gone (alive pipe / pool socket) and take their trees down themselves.
                    os._exit(0)
                self.handle(msg, fds)
            self.reap()
            if not events and not self.status and len(self.pool) < self.pool_target:
                try:
                    self.pool.append(self._fork_idle())
                except OSError:
                    self.pool_target = len(self.pool)

    def reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            except InterruptedError:
                continue
            if pid == 0:
                return
            fd = self.status.pop(pid, None)
            if fd is None:
                for i, (ppid, psock) in enumerate(self.pool):
                    if ppid == pid:  # an idle child died (killed from outside)
                        psock.close()
                        del self.pool[i]
                        break
                continue
            try:
                os.write(fd, _STATUS.pack(os.waitstatus_to_exitcode(status)))
            except OSError:
                pass
            os.close(fd)

    def handle(self, msg: dict[str, Any], fds: list[int]) -> None:
        op = msg.get("op")
        if op == "fork":
            try:
                pids = self.fork(msg["ranks"], fds)
            except Exception as exc:
                _send(self.sock, {"ok": False, "error": f"{type(exc).__name__}: {exc}"})
                return
            _send(self.sock, {"ok": True, "pids": pids})
        elif op == "info":
            _send(self.sock, {"ok": True, **self.info()})
        else:
            for fd in fds:
                os.close(fd)
            _send(self.sock, {"ok": False, "error": f"unknown request {op!r}"})

    def fork(self, ranks: list[dict[str, Any]], fds: list[int]) -> list[int]:
        """Start one child per rank (idle pool first); all or nothing. Consumes ``fds``."""
        pids: list[int] = []
        self.pool_target = max(self.pool_target, min(len(ranks), _POOL_MAX))
        try:
            if len(fds) != _FDS_PER_RANK * len(ranks):
                raise ValueError(f"expected {_FDS_PER_RANK * len(ranks)} fds, got {len(fds)}")
            for i, r in enumerate(ranks):
                mine = fds[_FDS_PER_RANK * i : _FDS_PER_RANK * (i + 1)]
                pid = self._assign_idle(r, mine)
                if pid is None:
                    pid = self._fork_rank(r, mine, fds)
                pids.append(pid)
        except BaseException:
            for pid in pids:  # a half-started gang is of no use
                try:
                    os.killpg(pid, signal.SIGKILL)
                except OSError:
                    pass
            for fd in fds[_FDS_PER_RANK * len(pids) :]:
                try:
                    os.close(fd)
                except OSError:
                    pass
            raise
        return pids

    def _took(self, pid: int, mine: list[int]) -> int:
        out_w, err_w, live_r, status_w = mine
        self.status[pid] = status_w
        for fd in (out_w, err_w, live_r):
            os.close(fd)
        return pid

    def _assign_idle(self, r: dict[str, Any], mine: list[int]) -> int | None:
        while self.pool:
            pid, psock = self.pool.pop(0)
            try:
                _send(psock, {"rank": r}, mine[:3])
            except OSError:  # it died meanwhile; reap() collects it
                continue
            finally:
                psock.close()
            return self._took(pid, mine)
        return None

    def _fork_rank(self, r: dict[str, Any], mine: list[int], fds: list[int]) -> int:
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child never returns
            self._child(lambda: self._leave_server(keep=mine[:3], close=fds), r, mine[:3])
        return self._took(pid, mine)

    def _fork_idle(self) -> tuple[int, socket.socket]:
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child never returns

            def wait_for_work() -> tuple[dict[str, Any], list[int]]:
                mine.close()
                self._leave_server(keep=[theirs.fileno()], close=[])
                theirs.setblocking(True)
                msg, fds = _recv(theirs, 3)
                theirs.close()
                if msg is None or len(fds) != 3:
                    os._exit(0)  # the server is gone, or it gave up on us
                return msg["rank"], fds

            self._child(wait_for_work, None, None)
        theirs.close()
        return pid, mine

    # -- in the child -----------------------------------------------------------------
    def _child(self, prepare: Any, r: dict[str, Any] | None, fds: list[int] | None) -> None:
        code = 70
        try:
            got = prepare()
            if got is not None:
                r, fds = got
            assert r is not None and fds is not None
            self._become_rank(r, fds)
        except BaseException:
            try:
                import traceback

                traceback.print_exc()
                sys.stderr.flush()
            except BaseException:
                pass
        finally:
            os._exit(code)

    def _leave_server(self, keep: list[int], close: list[int]) -> None:
        """Right after the fork: own session, default signals, none of the server's fds."""
        os.setsid()
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_SETMASK, [])
        fds = [self.sock.fileno(), self.alive_w, self.wake_r, self.wake_w]
        fds += list(self.status.values()) + [s.fileno() for _, s in self.pool] + list(close)
        for fd in fds:
            if fd in keep or fd < 0:
                continue
            try:
                os.close(fd)
            except OSError:
                pass
        self.sock.detach()
        for _, s in self.pool:
            s.detach()
        self.pool = []
        self.status = {}

    def _become_rank(self, r: dict[str, Any], fds: list[int]) -> None:
        out_w, err_w, live_r = fds
        os.dup2(out_w, 1)
        os.dup2(err_w, 2)
        os.close(out_w)
        os.close(err_w)
        env = dict(r["env"])
        env["GANGRUN_LIVENESS_FD"] = str(live_r)
        os.environ.clear()
        os.environ.update(env)
        _publish_environ(env, self.pad_len)
        cwd = env.get("GANGRUN_CWD") or r.get("cwd")
        if cwd:
            try:
                os.chdir(cwd)
            except OSError:
                pass
        _reset_std_streams(env)
        sys.dont_write_bytecode = bool(env.get("PYTHONDONTWRITEBYTECODE"))
        _reseed(env)
        import importlib

        importlib.invalidate_caches()
        # The server's death must take this rank down too (like the caller's).
        os.set_inheritable(self.alive_r, False)
        from .. import worker

        threading.Thread(
            target=worker._watch_liveness,
            args=(self.alive_r,),
            name="gangrun-forkserver-liveness",
            daemon=True,
        ).start()
        worker.main()  # ends with os._exit


def _publish_environ(env: dict[str, str], pad_len: int) -> None:
    """Make ``/proc/self/environ`` show the rank's environment.

    The kernel reports the environment block the process was exec'ed with; a forked child
    would show the server's. The server was started with a large padding variable first in
    its block; the child overwrites that padding in place (the rest of the block stays as it
    was, after an empty entry that ends the list for every reader)."""
    import ctypes

    try:
        with open("/proc/self/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        start = int(fields[47])  # env_start: field 50 of /proc/PID/stat
        head = (PAD_VAR + "=").encode()
        if start == 0 or ctypes.string_at(start, len(head)) != head:
            return
        first = [k for k in env if k.startswith("GANGRUN_")]
        first += [k for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")]
        order = list(dict.fromkeys([k for k in first if k in env] + list(env)))
        blob = bytearray()
        for k in order:
            entry = os.fsencode(k) + b"=" + os.fsencode(env[k]) + b"\0"
            if len(blob) + len(entry) > pad_len - 1:
                continue
            blob += entry
        blob += b"\0" * (pad_len - len(blob))
        ctypes.memmove(start, bytes(blob), pad_len)
    except Exception:
        pass


def _reset_std_streams(env: dict[str, str]) -> None:
    """New ``sys.stdout``/``sys.stderr`` over fds 1 and 2, set up as a fresh interpreter
    with this environment would (``PYTHONUNBUFFERED``, ``PYTHONIOENCODING``)."""
    import io

    unbuffered = bool(env.get("PYTHONUNBUFFERED"))
    enc_spec = env.get("PYTHONIOENCODING", "")
    enc, _, errs = enc_spec.partition(":")

    def make(fd: int, old: Any, errors_default: str) -> io.TextIOWrapper:
        raw = io.FileIO(fd, "w", closefd=False)
        tty = raw.isatty()
        buf: Any = raw if unbuffered else io.BufferedWriter(raw)
        return io.TextIOWrapper(
            buf,
            encoding=enc or getattr(old, "encoding", None) or "utf-8",
            errors=errs or getattr(old, "errors", None) or errors_default,
            line_buffering=tty or (fd == 2 and not unbuffered),
            write_through=unbuffered,
        )

    sys.stdout = make(1, sys.__stdout__, "strict")
    sys.stderr = make(2, sys.__stderr__, "backslashreplace")
    sys.__stdout__ = sys.stdout  # type: ignore[misc]
    sys.__stderr__ = sys.stderr  # type: ignore[misc]


def _reseed(env: dict[str, str]) -> None:
    import random

    random.seed()
    np_random = sys.modules.get("numpy.random")  # not imported yet: seeded when it is
    if np_random is not None:
        try:
            np_random.seed()
        except Exception:
            pass
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            torch.default_generator.seed()  # a fresh interpreter gets a random CPU seed
        except Exception:
            pass
        n = env.get("OMP_NUM_THREADS", "")
        if n.strip().isdigit() and int(n) > 0:
            try:
                torch.set_num_threads(int(n))
            except Exception:
                pass


def serve(fd: int) -> None:
    """Entry point of the fork server process."""
    sock = socket.socket(fileno=fd)
    sock.setblocking(True)
    server = _Server(sock)
    server.init()
    server.loop()


# ======================================================================== caller side
class ForkServerError(RuntimeError):
    pass


class ForkServer:
    """The caller's handle on its fork server process."""

    def __init__(
        self, preload: tuple[str, ...], env_sig: tuple[tuple[str, str], ...], pool: int = 2
    ) -> None:
        self.preload = preload
        self.env_sig = env_sig
        self.owner = os.getpid()
        self.lock = threading.Lock()
        self.info: dict[str, Any] = {}
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        for s in (parent, child):
            for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
                try:
                    s.setsockopt(socket.SOL_SOCKET, opt, _SOCK_BUF)
                except OSError:
                    pass
        env = {PAD_VAR: "x" * (PAD_LEN - len(PAD_VAR) - 2)}
        for k, v in os.environ.items():
            if k in _SERVER_DROP or k.startswith(_SERVER_DROP_PREFIXES) or _startup_var(k):
                continue
            env[k] = v
        env.update(dict(env_sig))
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", _BOOT.format(path=_GANGRUN_PARENT), str(child.fileno())],
                pass_fds=(child.fileno(),),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                env=env,
                start_new_session=True,  # no terminal signals (Ctrl-C) for the server
            )
        except BaseException:
            parent.close()
            raise
        finally:
            child.close()
        self.sock = parent
        try:
            _send(
                parent,
                {"op": "init", "sys_path": list(sys.path), "preload": list(preload), "pool": pool},
            )
            parent.settimeout(float(os.environ.get("GANGRUN_FORKSERVER_START_TIMEOUT", "300")))
            msg, _ = _recv(parent)
            if msg is None or not msg.get("ready"):
                raise ForkServerError(
                    f"the fork server did not start (exit code {self.proc.poll()})"
                )
            self.info = msg
        except BaseException:
            self.close(0.0)
            raise

    @property
    def pid(self) -> int:
        return int(self.proc.pid)

    def alive(self) -> bool:
        return self.proc.poll() is None and self.sock.fileno() != -1

    def request(self, msg: dict[str, Any], fds: list[int] = (), timeout: float = 60.0) -> Any:  # type: ignore[assignment]
        with self.lock:
            self.sock.settimeout(timeout)
            _send(self.sock, msg, fds)
            reply, extra = _recv(self.sock)
        for fd in extra:
            os.close(fd)
        if reply is None:
            raise ConnectionResetError("the fork server closed its channel")
        if not reply.get("ok"):
            raise ForkServerError(reply.get("error", "fork server request failed"))
        return reply

    def fork(self, ranks: list[dict[str, Any]], fds: list[int]) -> list[int]:
        pids: list[int] = []
        for i in range(0, len(ranks), _RANKS_PER_MSG):
            chunk = ranks[i : i + _RANKS_PER_MSG]
            chunk_fds = fds[_FDS_PER_RANK * i : _FDS_PER_RANK * (i + len(chunk))]
            pids += self.request({"op": "fork", "ranks": chunk}, chunk_fds)["pids"]
        return pids

    def close(self, wait: float = 2.0) -> None:
        try:
            self.sock.close()
        except OSError:
            pass
        try:
            self.proc.wait(wait)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            try:
                self.proc.wait(5.0)
            except subprocess.TimeoutExpired:  # pragma: no cover
                pass


_server: ForkServer | None = None
_server_lock = threading.Lock()
_atexit_registered = False
_start_failure: str | None = None


def preload_modules() -> tuple[str, ...]:
    raw = os.environ.get("GANGRUN_PRELOAD", DEFAULT_PRELOAD)
    if raw.strip().lower() in ("", "none", "0", "false"):
        return ()
    return tuple(m.strip() for m in raw.split(",") if m.strip())


def get_server(env_sig: tuple[tuple[str, str], ...] | None = None, pool: int = 2) -> ForkServer:
    """This caller's fork server, started (or restarted) as needed."""
    global _server, _atexit_registered, _start_failure
    preload = preload_modules()
    if env_sig is None:
        env_sig = startup_signature(dict(os.environ))
    with _server_lock:
        s = _server
        if s is not None and s.owner != os.getpid():  # we are a fork of the original caller
            s = _server = None
        if s is not None and (not s.alive() or s.preload != preload or s.env_sig != env_sig):
            s.close(0.5)
            s = _server = None
        if s is None:
            try:
                s = ForkServer(preload, env_sig, pool)
            except BaseException as exc:
                _start_failure = f"{type(exc).__name__}: {exc}"
                raise
            _start_failure = None
            _server = s
            if not _atexit_registered:
                atexit.register(shutdown)
                _atexit_registered = True
        return s


def discard_server() -> None:
    """Forget (and stop) the current server: the next launch starts a new one."""
    global _server
    with _server_lock:
        s, _server = _server, None
    if s is not None and s.owner == os.getpid():
        s.close(0.5)


def current_server() -> ForkServer | None:
    s = _server
    return s if s is not None and s.owner == os.getpid() and s.alive() else None


def shutdown() -> None:
    """Stop the fork server (atexit; the lifecycle's hook has ended the active calls)."""
    global _server
    with _server_lock:
        s, _server = _server, None
    if s is not None and s.owner == os.getpid():
        s.close(2.0)


def usable() -> bool:
    return (
        sys.platform.startswith("linux")
        and hasattr(os, "fork")
        and hasattr(socket, "send_fds")
        and hasattr(socket, "AF_UNIX")
    )


def launcher_for(start_method: str) -> Any:
    """The gang class for a start method: ``auto`` = fork server on Linux when usable."""
    method = start_method
    if method == "auto":
        method = os.environ.get("GANGRUN_START_METHOD", "auto") or "auto"
    if method == "spawn":
        return LocalGang
    if method == "forkserver" or (method == "auto" and usable() and _start_failure is None):
        return ForkServerGang
    return LocalGang


class ForkServerGang:
    """The rank processes of one attempt, forked by the fork server (same interface as
    :class:`LocalGang`; falls back to one when the server cannot be used)."""

    def __init__(self, spec: GangSpec, pump: Any) -> None:
        self.spec = spec
        self.pump = pump
        self._pids: dict[int, int] = {}
        self.exits: queue.Queue[RankExit] = queue.Queue()
        self.exitcodes: dict[int, int] = {}
        self._done: dict[int, threading.Event] = {}
        self._waiters: list[threading.Thread] = []
        self._live_r, self._live_w = os.pipe()
        self.started_at = time.time()
        self._since_ticks = ticks_now()
        self._logs: list[Any] = []
        self._fallback: LocalGang | None = None
        self.server_pid: int | None = None

    @property
    def pids(self) -> dict[int, int]:
        return self._fallback.pids if self._fallback is not None else self._pids

    @property
    def procs(self) -> dict[int, Any]:
        return self._fallback.procs if self._fallback is not None else dict(self._pids)

    # -- start ------------------------------------------------------------------------
    def start(self) -> None:
        spec = self.spec
        env_sig = startup_signature(spec.ranks[0].env) if spec.ranks else ()
        try:
            try:
                server = get_server(env_sig, len(spec.ranks))
                self._start_on(server)
            except (OSError, ForkServerError, EOFError, pickle.PickleError):
                # The server died or broke: one fresh server, then the spawn path.
                self._discard_partial()
                discard_server()
                server = get_server(env_sig, len(spec.ranks))
                self._start_on(server)
        except Exception as exc:
            self._discard_partial()
            self._start_fallback(exc)
            return
        finally:
            if self._live_r != -1:
                os.close(self._live_r)
                self._live_r = -1
        self.pump.start()

    def _start_on(self, server: ForkServer) -> None:
        spec = self.spec
        send: list[int] = []
        keep: list[tuple[int, int, int, int]] = []  # out_r, err_r, status_r, log index
        ranks = []
        try:
            for r in spec.ranks:
                out_r, out_w = os.pipe()
                err_r, err_w = os.pipe()
                st_r, st_w = os.pipe()
                keep.append((out_r, err_r, st_r, r.rank))
                send += [out_w, err_w, self._live_r, st_w]
                ranks.append({"rank": r.rank, "env": r.env, "cwd": r.env.get("GANGRUN_CWD")})
            pids = server.fork(ranks, send)
        except BaseException:
            for fd in [fd for k in keep for fd in k[:3]]:
                os.close(fd)
            raise
        finally:
            for fd in send:
                if fd != self._live_r:
                    try:
                        os.close(fd)
                    except OSError:
                        pass
        self.server_pid = server.pid
        # fds not yet handed to their owner (the pump, a waiter thread): closed here if the
        # hand-over is interrupted (e.g. Ctrl-C just after the fork), so none leaks
        pending = [set(k[:3]) for k in keep]
        try:
            for (out_r, err_r, st_r, rank), pid, mine in zip(keep, pids, pending, strict=True):
                self._pids[rank] = pid
                self._done[rank] = threading.Event()
                log_fd = os.open(
                    os.path.join(spec.log_dir, f"rank-{rank}.log"),
                    os.O_WRONLY | os.O_CREAT | os.O_APPEND,
                    0o600,
                )
                log = os.fdopen(log_fd, "ab", buffering=0)
                self._logs.append(log)
                self.pump.add(rank, "out", out_r, log)
                mine.discard(out_r)
                self.pump.add(rank, "err", err_r, log)
                mine.discard(err_r)
                t = threading.Thread(
                    target=self._wait,
                    args=(rank, pid, st_r),
                    name=f"gangrun-wait-{rank}",
                    daemon=True,
                )
                t.start()
                mine.discard(st_r)
                self._waiters.append(t)
        except BaseException:
            for fd in [fd for mine in pending for fd in mine]:
                try:
                    os.close(fd)
                except OSError:
                    pass
            raise

    def _discard_partial(self) -> None:
        """Forget ranks of a failed start (nothing was forked, or they die with the server)."""
        if self._pids:
            _signal_tree(list(self._pids.values()), signal.SIGKILL)
            sweep(self.spec.run_id, self._since_ticks)
        self._pids.clear()

    def _start_fallback(self, exc: BaseException) -> None:
        print(
            f"gangrun: the fork server is unavailable ({type(exc).__name__}: {exc}); "
            "starting fresh interpreters instead (start_method='spawn').",
            file=sys.stderr,
        )
        if self._live_w != -1:
            os.close(self._live_w)
            self._live_w = -1
        for log in self._logs:
            log.close()
        self._logs.clear()
        gang = LocalGang(self.spec, self.pump)
        gang.exits = self.exits
        self._fallback = gang
        gang.start()

    # -- exits ------------------------------------------------------------------------
    def _wait(self, rank: int, pid: int, fd: int) -> None:
        data = b""
        try:
            while len(data) < _STATUS.size:
                try:
                    chunk = os.read(fd, _STATUS.size - len(data))
                except InterruptedError:
                    continue
                if not chunk:
                    break
                data += chunk
        except OSError:
            pass
        finally:
            os.close(fd)
        if len(data) == _STATUS.size:
            code = _STATUS.unpack(data)[0]
        else:
            # The server died with this rank running: the rank kills its own tree when it
            # sees that (liveness pipe); make sure it is gone and report it as killed.
            _signal_tree([pid], signal.SIGKILL)
            wait_gone(pid, 5.0)
            code = -signal.SIGKILL
            try:
                print(
                    f"gangrun: the fork server died while rank {rank} (pid {pid}) was running; "
                    "the rank was stopped.",
                    file=sys.stderr,
                )
            except Exception:
                pass
        self.exitcodes[rank] = code
        self._done[rank].set()
        self.exits.put(RankExit(rank, code, time.time()))

    def next_exit(self, timeout: float | None) -> RankExit | None:
        try:
            return self.exits.get(timeout=timeout)
        except queue.Empty:
            return None

    def alive(self) -> list[int]:
        if self._fallback is not None:
            return self._fallback.alive()
        return [r for r, ev in self._done.items() if not ev.is_set()]

    def _wait_all(self, deadline: float) -> bool:
        return all(ev.wait(max(0.0, deadline - time.monotonic())) for ev in self._done.values())

    def stop(self, grace: float | None = None) -> None:
        """SIGTERM every rank's tree, wait up to ``grace``, then SIGKILL what is left."""
        if self._fallback is not None:
            self._fallback.stop(grace)
            return
        grace = self.spec.grace_period if grace is None else grace
        if self.alive():
            _signal_tree(list(self._pids.values()), signal.SIGTERM)
            self._wait_all(time.monotonic() + grace)
        self.reap_leftovers()

    def reap_leftovers(self) -> None:
        """Kill whatever is left of the ranks' trees (descendants included)."""
        if self._fallback is not None:
            self._fallback.reap_leftovers()
            return
        _signal_tree(list(self._pids.values()), signal.SIGKILL)
        self._wait_all(time.monotonic() + 5.0)
        sweep(self.spec.run_id, self._since_ticks)

    def close(self) -> None:
        if self._fallback is not None:
            self._fallback.close()
            return
        release_gang(self)


def server_info() -> dict[str, Any] | None:
    """What the running fork server reports about itself (pid, preloaded modules, whether
    CUDA is initialised in it), or ``None`` when none is running."""
    s = current_server()
    if s is None:
        return None
    try:
        return dict(s.request({"op": "info"}, timeout=10.0))
    except Exception:
        return None
