"""One call of a distributed function: check, launch, watch, collect, tear down.

``Run.start()`` does everything that can fail before anything runs (raising ``LaunchError``)
and starts the ranks; a monitor thread then waits for rank exits, the timeout, a cancel or a
restart, tears the gang down and settles the outcome. ``api.RunHandle`` is the public face.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from . import security, serialization
from .errors import (
    DistributedCancelledError,
    DistributedError,
    DistributedTimeoutError,
    LaunchError,
    signal_name,
)
from .launch import GangSpec, RankExit, RankSpec
from .notebook.source import with_sources
from .platform import cpu_count, process_identity

_CANCEL = -1
_active_lock = threading.Lock()
_active: set[Run] = set()


_recent_ports: list[int] = []  # handed out lately: concurrent calls never get the same one


def free_port(host: str = "127.0.0.1") -> int:
    for _ in range(64):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = int(s.getsockname()[1])
        with _active_lock:
            if port not in _recent_ports:
                _recent_ports.append(port)
                del _recent_ports[:-256]
                return port
    return port


def _tail(path: str, lines: int = 30) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 16384))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


_reaped_stale = False


def reap_stale_run_dirs() -> list[str]:
    """Remove run directories (payloads, logs) left in the temp dir by callers of this user
    that died without cleaning up (SIGKILL, a kernel restart). Once per process; cheap."""
    global _reaped_stale
    if _reaped_stale:
        return []
    _reaped_stale = True
    removed: list[str] = []
    tmp = tempfile.gettempdir()
    try:
        names = [n for n in os.listdir(tmp) if n.startswith("gangrun-")]
    except OSError:
        return removed
    uid = os.getuid()
    for name in names:
        path = os.path.join(tmp, name)
        try:
            st = os.lstat(path)
            if st.st_uid != uid or not os.path.isdir(path) or os.path.islink(path):
                continue
            with open(os.path.join(path, "context.json")) as f:
                caller = json.load(f).get("caller")
        except (OSError, ValueError):
            continue
        if not caller:
            continue
        pid = int(caller.split(":", 1)[0])
        if process_identity(pid) != caller:  # that caller is gone
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


class Run:
    def __init__(
        self,
        fn: Callable[..., Any],
        args: tuple,
        kwargs: dict,
        options: Any,
        stdout: Any = None,
        stderr: Any = None,
    ) -> None:
        self.fn = fn
        self.args = args
        self.kwargs = kwargs
        self.opts = options
        self.stdout = stdout if stdout is not None else sys.stdout
        self.stderr = stderr if stderr is not None else sys.stderr
        self.run_id = uuid.uuid4().hex[:12]
        self.fn_name = getattr(fn, "__qualname__", getattr(fn, "__name__", repr(fn)))
        self.world_size = 0
        self.devices: list[Any] = []
        self.gpu_name: str | None = None
        self.run_dir = ""
        self.log_dir = ""
        self.attempt = 0
        self.tracker: Any = None
        self.gang: Any = None
        self._done = threading.Event()
        self._cancel_reason: str | None = None
        self._lock = threading.Lock()
        self._results: list[Any] | None = None
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._started = 0.0
        self._released = False
        self._reservation: Any = None
        self.progress: Any = None  # notebook.state.CallState: told of each transition

    def _tell(self, event: str, *args: Any) -> None:
        if self.progress is not None:
            getattr(self.progress, event)(*args)

    # ------------------------------------------------------------------ launch
    def _resolve_world(self) -> None:
        o = self.opts
        from . import accelerators

        if o.processes is not None and o.gpu_type is None:
            self.world_size = o.processes
            return
        devs = accelerators.detect()
        if o.processes is not None:  # gpu_type given in CPU mode: still check what is attached
            self.world_size = o.processes
        elif not devs:
            raise LaunchError(
                "No GPU was found on this node (checked NVML, nvidia-smi and torch). "
                "To run on CPU processes instead (gloo), pass processes=N, e.g. "
                "@distributed(processes=2)."
            )
        else:
            want = o.gpus if o.gpus is not None else len(devs)
            if want > len(devs):
                names = ", ".join(sorted({d.name for d in devs}))
                raise LaunchError(
                    f"gpus={want} but this node has {len(devs)} visible GPU(s) ({names}). "
                    f"Ask for at most gpus={len(devs)}, or run on a bigger node (backend='ray')."
                )
            self.world_size = want
            from .reservation import reserve

            # concurrent calls (threads, other notebooks of this user) never share a GPU
            self._reservation = reserve(devs, want, getattr(o, "gpu_wait", 0.0))
            self.devices = self._reservation.devices
        if o.gpu_type is not None:
            pool = self.devices or devs
            if not pool:
                raise LaunchError(
                    f"gpu_type={o.gpu_type!r} was requested but no GPU is attached to this node."
                )
            bad = [d for d in pool if not accelerators.matches_type(d.name, o.gpu_type)]
            if bad:
                raise LaunchError(
                    f"gpu_type={o.gpu_type!r} does not match the attached accelerator "
                    f"{bad[0].name!r} (GPU {bad[0].index}). Drop gpu_type to accept it, or run "
                    "on a node with the requested GPU."
                )
        if self.devices:
            self.gpu_name = self.devices[0].name

    def _base_env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update({str(k): str(v) for k, v in (self.opts.env or {}).items()})
        if "OMP_NUM_THREADS" not in env:
            env["OMP_NUM_THREADS"] = str(max(1, cpu_count() // max(1, self.world_size)))
        if self.devices:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(d.index) for d in self.devices)
        if getattr(self.opts, "backend", "local") == "local":
            # one node: gloo's pairs listen on loopback only (docs/security.md)
            env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        if self.opts.hang_timeout is not None:
            env["GANGRUN_HANG_TIMEOUT"] = str(self.opts.hang_timeout)
        if self.tracker is not None:
            env.update(self.tracker.rank_env())
        return env

    def _gang_spec(self) -> GangSpec:
        base = self._base_env()
        port = free_port()
        n = self.world_size
        ranks = []
        for r in range(n):
            env = dict(base)
            env.update(
                {
                    "RANK": str(r),
                    "LOCAL_RANK": str(r),
                    "WORLD_SIZE": str(n),
                    "LOCAL_WORLD_SIZE": str(n),
                    "NODE_RANK": "0",
                    "GROUP_RANK": "0",
                    "GROUP_WORLD_SIZE": "1",
                    "ROLE_NAME": "default",
                    "ROLE_RANK": str(r),
                    "ROLE_WORLD_SIZE": str(n),
                    "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(port),
                    "TORCHELASTIC_RUN_ID": self.run_id,
                    "TORCHELASTIC_RESTART_COUNT": str(self.attempt),
                    "TORCHELASTIC_MAX_RESTARTS": str(self.opts.max_restarts),
                    "PYTHONUNBUFFERED": "1",
                    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
                    "GANGRUN_RUN_ID": self.run_id,
                    "GANGRUN_RUN_DIR": self.run_dir,
                    "GANGRUN_CALLER_PID": str(os.getpid()),
                }
            )
            ranks.append(RankSpec(r, env))
        return GangSpec(
            run_id=self.run_id,
            run_dir=self.run_dir,
            ranks=ranks,
            log_dir=self.log_dir,
            output=self.opts.output,
            grace_period=self.opts.grace_period,
        )

    def _make_dirs(self) -> None:
        reap_stale_run_dirs()
        self.run_dir = tempfile.mkdtemp(prefix=f"gangrun-{self.run_id}-")
        os.chmod(self.run_dir, 0o700)
        if self.opts.log_dir:
            self.log_dir = os.path.join(os.path.abspath(self.opts.log_dir), self.run_id)
            os.makedirs(self.log_dir, mode=0o700, exist_ok=True)
        else:
            self.log_dir = os.path.join(self.run_dir, "logs")
            os.mkdir(self.log_dir, 0o700)
        ctx = {
            "sys_path": [p for p in sys.path],
            "cwd": os.getcwd(),
            "argv": list(sys.argv[:1]),
            "caller": process_identity(os.getpid()),
        }
        fd = os.open(os.path.join(self.run_dir, "context.json"), os.O_WRONLY | os.O_CREAT, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(ctx, f)

    def _launcher(self) -> Any:
        from .launch.forkserver import launcher_for

        return launcher_for(self.opts.start_method)

    def start(self) -> None:
        self._started = time.monotonic()
        try:
            self._resolve_world()
        except BaseException:
            self._release_gpus()
            raise
        self._tell("starting", self.world_size)
        self._make_dirs()
        try:
            serialization.write_payload(
                os.path.join(self.run_dir, "payload.pkl"),
                with_sources(self.fn),
                self.args,
                self.kwargs,
                self.opts.max_capture_bytes,
            )
            if self.opts.mlflow:
                from .tracking import Tracker

                self.tracker = Tracker.start(self.tracking_info(), self.stdout)
                t = self.tracker
                if t is not None:
                    self._tell("tracking", t.run_id, t.tracking_uri, t.experiment_id)
            self._launch_attempt()
        except BaseException as exc:
            # e.g. KeyboardInterrupt in the middle of starting the ranks: stop what started
            self._abort_launch()
            self._release_gpus()
            if self.tracker is not None:  # the run was created: never leave it RUNNING
                try:
                    status = "FAILED" if isinstance(exc, Exception) else "KILLED"
                    self.tracker.finish(status, exc, {})
                except Exception:
                    pass
            self._remove_dir()
            self._tell("ended", "FAILED" if isinstance(exc, Exception) else "KILLED", exc)
            raise
        with _active_lock:
            _active.add(self)
        self._thread = threading.Thread(
            target=self._monitor, name=f"gangrun-run-{self.run_id}", daemon=True
        )
        self._thread.start()

    def tracking_info(self) -> dict[str, Any]:
        o = self.opts
        from . import __version__

        scalars = {}
        for k, v in self.kwargs.items():
            if isinstance(v, (int, float, str, bool)) or v is None:
                scalars[k] = v
        for i, v in enumerate(self.args):
            if isinstance(v, (int, float, str, bool)) or v is None:
                scalars[f"arg{i}"] = v
        return {
            "function": self.fn_name,
            "world_size": self.world_size,
            "processes": o.processes,
            "gpus": o.gpus if o.processes is None else None,
            "gpu_type": self.gpu_name or o.gpu_type,
            "timeout": o.timeout,
            "version": __version__,
            "host": socket.gethostname(),
            "args": scalars,
            "run_id": self.run_id,
            "log_system_metrics": getattr(o, "log_system_metrics", False),
        }

    def _launch_attempt(self) -> None:
        from .output import OutputPump

        on_line = None if self.progress is None else self.progress.rank_line
        self.pump = OutputPump(self.stdout, self.stderr, self.opts.output, on_line)
        self.gang = self._launcher()(self._gang_spec(), self.pump)
        self.gang.start()
        self._tell("attempt_started", self.attempt)

    # ------------------------------------------------------------------ monitor
    def _monitor(self) -> None:
        status = "FAILED"
        error: BaseException | None = None
        try:
            while True:
                outcome = self._watch_attempt()
                if outcome is None:
                    self._results = self._collect()
                    status = "FINISHED"
                    break
                error = outcome
                if (
                    isinstance(outcome, (DistributedTimeoutError, DistributedCancelledError))
                    or self.attempt >= self.opts.max_restarts
                ):
                    break
                self.attempt += 1
                print(
                    f"gangrun: {outcome.args[0].splitlines()[0]} "
                    f"Restarting the gang (restart {self.attempt}/{self.opts.max_restarts}).",
                    file=self.stderr,
                )
                self._clear_attempt_files()
                self._launch_attempt()
            if error is not None and status != "FINISHED":
                if isinstance(error, (DistributedTimeoutError, DistributedCancelledError)):
                    status = "KILLED"
                self._error = error
        except BaseException as exc:  # a bug in gangrun itself: never leave ranks behind
            try:
                self.gang.stop(0.5)
            except Exception:
                pass
            self._error = exc
            status = "FAILED"
        finally:
            self._finish(status)

    def _watch_attempt(self) -> DistributedError | None:
        gang = self.gang
        timeout = self.opts.timeout
        deadline = None if timeout is None else self._started + timeout
        remaining = set(range(self.world_size))
        exits: dict[int, RankExit] = {}
        first_failure: RankExit | None = None
        reason: str | None = None
        guard = None
        if self.opts.hang_timeout is not None:
            from .hang import HangGuard

            guard = HangGuard(self.run_dir, self.log_dir, self.world_size, self.opts.hang_timeout)
        try:
            while remaining:
                if self._cancel_reason is not None:
                    reason = "cancel"
                    break
                wait = None if deadline is None else deadline - time.monotonic()
                if wait is not None and wait <= 0:
                    reason = "timeout"
                    break
                if guard is not None:
                    wait = guard.poll_interval if wait is None else min(wait, guard.poll_interval)
                ev = gang.next_exit(wait)
                if ev is None:
                    live = sorted(remaining)
                    if guard is not None and guard.check(live):
                        guard.dump_stacks(gang.pids, live)
                        reason = "hang"
                        break
                    continue
                if ev.rank == _CANCEL:
                    reason = "cancel"
                    break
                exits[ev.rank] = ev
                self._tell("rank_exit", ev.rank, ev.exitcode)
                remaining.discard(ev.rank)
                if ev.exitcode != 0:
                    first_failure = ev
                    break
        finally:
            teardown_at = time.time()
            if remaining:
                gang.stop()
            else:
                gang.reap_leftovers()
            self.pump.close(drain_timeout=2.0)
            gang.close()
        while True:  # exits that arrived during the teardown
            ev = gang.next_exit(0)
            if ev is None:
                break
            if ev.rank != _CANCEL and ev.rank not in exits:
                exits[ev.rank] = ev
                self._tell("rank_exit", ev.rank, ev.exitcode, True)
        if reason == "timeout":
            return DistributedTimeoutError(
                f"{self.fn_name} did not finish within timeout={timeout:g}s; all "
                f"{self.world_size} ranks were stopped.",
                run_id=self.run_id,
            )
        if reason == "hang" and guard is not None:
            return guard.error(self.fn_name, self.run_id, self.log_dir)  # type: ignore[no-any-return]
        if reason == "cancel":
            return DistributedCancelledError(
                f"{self.fn_name} was {self._cancel_reason or 'cancelled'}; all "
                f"{self.world_size} ranks were stopped.",
                run_id=self.run_id,
            )
        if first_failure is None:
            return None
        return self._root_cause(exits, first_failure, teardown_at)

    def _read_error(self, rank: int) -> dict[str, Any] | None:
        from .worker import error_path

        try:
            return security.load_private(error_path(self.run_dir, rank))  # type: ignore[no-any-return]
        except Exception:
            return None

    def _root_cause(
        self, exits: dict[int, RankExit], first: RankExit, teardown_at: float
    ) -> DistributedError:
        from . import rootcause

        candidates: list[Any] = []
        late: list[Any] = []  # died without a record just after the teardown began: maybe not by it
        late_window = min(1.0, self.opts.grace_period)
        for rank, ev in exits.items():
            if ev.exitcode == 0:
                continue
            rec = self._read_error(rank)
            t = rec["time"] if rec else ev.time
            if rank == first.rank or t <= teardown_at:
                candidates.append((t, rank, ev, rec))
            elif rec is None and t <= teardown_at + late_window:
                late.append((t, rank, ev, rec))
        _, rank, ev, rec = rootcause.pick(candidates, late)
        log_file = os.path.join(self.log_dir, f"rank-{rank}.log")
        tail = _tail(log_file)
        pid = self.gang.pids.get(rank)
        code = ev.exitcode
        sig = signal_name(code)
        others = sorted(r for r in range(self.world_size) if r != rank)
        if rec is not None and rec.get("exc_type") != "SystemExit":
            head = f"Rank {rank} (pid {pid}) failed: {rec['exc_type']}: {rec['message']}"
            body = rec["traceback"]
        elif rec is not None:
            head = (
                f"Rank {rank} (pid {pid}) exited with code {rec.get('exitcode', code)} (sys.exit)."
            )
            body = tail
        elif sig is not None:
            hint = ""
            if sig == "SIGKILL":
                hint = " (often the out-of-memory killer: check `dmesg`, lower the batch size)"
            elif sig == "SIGSEGV":
                hint = " (a crash in native code: the log below holds the Python stack)"
            head = f"Rank {rank} (pid {pid}) was killed by {sig}{hint}."
            body = tail
        else:
            head = f"Rank {rank} (pid {pid}) exited with code {code} without a Python exception."
            body = tail
        extra = f"The other rank(s) {others} were stopped. " if others else ""
        msg = (
            f"{head}\n\n{body.rstrip()}\n\n"
            f"{extra}Full logs: err.logs(rank), or the files in {self.log_dir}"
        ).rstrip()
        err = DistributedError(
            msg,
            rank=rank,
            exitcode=code if rec is None or "exitcode" not in rec else rec["exitcode"],
            traceback=rec["traceback"] if rec else None,
            exc_type=rec["exc_type"] if rec else None,
            log_tail=tail,
            run_id=self.run_id,
        )
        if rec and rec.get("exc") is not None:
            try:
                import pickle

                cause = pickle.loads(rec["exc"])
                if isinstance(cause, BaseException):
                    err.__cause__ = cause
            except Exception:
                pass
        return err

    def _collect(self) -> list[Any]:
        from .worker import result_path

        out: list[Any] = []
        for r in range(self.world_size):
            p = result_path(self.run_dir, r)
            if not os.path.exists(p):
                out.append(None)  # the rank ended with exit code 0 but returned nothing (os._exit)
                continue
            try:
                out.append(security.load_private(p))  # only from a 0700 dir of this user
            except Exception as exc:
                raise DistributedError(
                    f"The result of rank {r} could not be loaded in the caller: "
                    f"{type(exc).__name__}: {exc}. Is its class importable here?",
                    rank=r,
                    run_id=self.run_id,
                ) from exc
            finally:
                os.unlink(p)
        return out

    def _clear_attempt_files(self) -> None:
        for name in os.listdir(self.run_dir):
            if name.startswith(("result.", "error.", "heartbeat.", "stacks.")):
                try:
                    os.unlink(os.path.join(self.run_dir, name))
                except OSError:
                    pass

    def _finish(self, status: str) -> None:
        try:
            if self.tracker is not None:
                self.tracker.finish(status, self._error, self.log_files())
        except Exception as exc:
            print(f"gangrun: could not finish the MLflow run: {exc}", file=self.stderr)
        finally:
            self._tell("ended", status, self._error)  # before done: the panel's final state
            try:
                os.unlink(os.path.join(self.run_dir, "payload.pkl"))
            except OSError:
                pass
            self._clear_attempt_files()
            self._release_gpus()
            with _active_lock:
                _active.discard(self)
                if self._released:
                    self._remove_dir()
                self._done.set()

    # ------------------------------------------------------------------ public-ish
    def log_files(self) -> dict[int, str]:
        return {r: os.path.join(self.log_dir, f"rank-{r}.log") for r in range(self.world_size)}

    def cancel(self, reason: str = "cancelled", wait: float = 30.0) -> bool:
        if self._done.is_set():
            return False
        with self._lock:
            if self._cancel_reason is None:
                self._cancel_reason = reason
            gang = self.gang
        if gang is not None:
            gang.exits.put(RankExit(_CANCEL, 0, time.time()))
        self._done.wait(wait)
        return True

    def wait(self, timeout: float | None = None) -> bool:
        # Wait in slices so the main thread stays responsive to KeyboardInterrupt even when it
        # is raised by _thread.interrupt_main() rather than a real SIGINT (which interrupts a
        # blocking wait anyway). The event still wakes the waiter at once when the run ends.
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = 0.25 if deadline is None else min(0.25, deadline - time.monotonic())
            if self._done.wait(max(0.0, left)):
                return True
            if deadline is not None and time.monotonic() >= deadline:
                return False

    def done(self) -> bool:
        return self._done.is_set()

    def outcome(self) -> list[Any]:
        if self._error is not None:
            raise self._error
        assert self._results is not None
        return self._results

    def release(self) -> None:
        """The handle is gone: remove the run directory now, or when the call ends."""
        with _active_lock:
            self._released = True
            done = self._done.is_set()
        if done:
            self._remove_dir()

    def _abort_launch(self) -> None:
        gang, self.gang = self.gang, None
        if gang is None:
            return
        try:
            gang.stop(0.0)
        finally:
            pump = getattr(self, "pump", None)
            if pump is not None:
                pump.close(drain_timeout=0.5)
            gang.close()

    def _release_gpus(self) -> None:
        res, self._reservation = self._reservation, None
        if res is not None:
            res.release()

    def _remove_dir(self) -> None:
        if self.run_dir:
            shutil.rmtree(self.run_dir, ignore_errors=True)


def stop_all(reason: str = "stopped because the caller is exiting") -> None:
    """Cancel every run still active in this process (atexit)."""
    with _active_lock:
        runs = list(_active)
    for r in runs:
        r.cancel(reason, wait=10.0)
