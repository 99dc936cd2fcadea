"""Ranks on a Ray cluster: ``backend="ray"``.

Ray is the engine; gangrun does not schedule nodes itself. One call reserves one placement
group bundle per rank (``{"GPU": 1}`` for ``gpus=``, ``{"CPU": 1}`` for ``processes=``; PACK
by default), starts one small actor per rank inside its bundle, and each actor runs its rank
exactly as the local launcher does: a fresh interpreter (``gangrun.worker``) in its own
process group, holding a liveness pipe whose write end lives in the actor. So when the actor
dies (``ray.kill``, the caller's driver exits, the node is lost) the rank kills its own tree.

The caller side (:class:`RayGang`) implements the same gang interface as
:class:`gangrun.launch.local.LocalGang`: rank output is polled from the actors and written into
local pipes read by the usual :class:`~gangrun.output.OutputPump` (``[rank N]`` prefixes, log
files), and each rank's result or error file is shipped back into the caller's run directory
before its exit is reported. Everything after that (results, root cause, timeout, cancel,
interrupt, MLflow, restarts) is the call's lifecycle (:mod:`gangrun.lifecycle`); the
placement is planned by :mod:`gangrun.lifecycle.ray_plan`.

Connection: ``address=`` or ``RAY_ADDRESS``; with neither, an already running local cluster
is joined (``ray.init(address="auto")``); ``address="local"`` starts a private Ray on this
machine for the call's process. If the caller already called ``ray.init`` that connection is
used as is.

Knobs (environment variables, read from ``env=`` first, then the caller's environment):

- ``GANGRUN_RAY_STRATEGY``: placement strategy, ``PACK`` (default), ``SPREAD``,
  ``STRICT_PACK`` or ``STRICT_SPREAD``.
- ``GANGRUN_RAY_RUNTIME_ENV``: JSON Ray runtime env merged into the actors' (``working_dir``,
  ``py_modules``, ``pip``, ``env_vars``...), to ship code the function imports by name;
  local directories are uploaded to the cluster as ``ray.init`` does, and with a
  ``working_dir`` the ranks run in its shipped copy.
- ``GANGRUN_RAY_PLACEMENT_TIMEOUT``: seconds to wait for the bundles (default 300).
- ``GANGRUN_RAY_FORWARD_ENV``: comma-separated names of further caller variables to ship.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

from ..errors import LaunchError
from . import GangSpec, RankExit

_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
# Caller variables shipped to remote ranks even though gangrun did not set them; the rest of
# the caller's environment (PATH, HOME, virtualenv...) belongs to the caller's machine.
_FORWARD_PREFIXES = (
    "MLFLOW_",
    "HF_",
    "HUGGINGFACE_",
    "TRANSFORMERS_",
    "TOKENIZERS_",
    "WANDB_",
    "NCCL_",
    "GLOO_",
    "TORCH_",
    "PYTORCH_",
    "CUDA_LAUNCH_BLOCKING",
    "OMP_",
    "MKL_",
    "AWS_",
    "FSSPEC_",
    "GANGRUN_",
    "PYTHONHASHSEED",
    "PYTHONFAULTHANDLER",
    "DS_",
)
# Per-node variables the actor computes (the caller's values mean nothing on another node).
_NODE_LOCAL = ("CUDA_VISIBLE_DEVICES", "GANGRUN_CWD")
POLL_S = 2.0  # an idle rank's poll returns this often; output and exits return at once


def _ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise LaunchError(
            "backend='ray' needs Ray: pip install 'gangrun[ray]' (or pip install 'ray[default]')."
        ) from exc
    return ray


def _knob(opts: Any, name: str, default: str | None = None) -> str | None:
    env = opts.env or {}
    if name in env:
        return str(env[name])
    return os.environ.get(name, default)


def connect(address: str | None) -> Any:
    """``ray.init`` once per caller process (reusing a connection the user already made)."""
    ray = _ray()
    if ray.is_initialized():
        return ray
    address = address or os.environ.get("RAY_ADDRESS") or None
    kwargs: dict[str, Any] = {
        "ignore_reinit_error": True,
        "log_to_driver": False,  # rank output is forwarded by gangrun itself
        "logging_level": "WARNING",
        "configure_logging": False,
    }
    try:
        if address == "local":
            ray.init(include_dashboard=False, **kwargs)
        else:
            ray.init(address=address or "auto", **kwargs)
    except ConnectionError as exc:
        raise LaunchError(
            f"Could not connect to a Ray cluster ({address or 'no address given, none running'}"
            f"): {str(exc).rstrip('.')}. Pass address='ray://host:10001' or 'host:6379' (or set RAY_ADDRESS), "
            "start one with `ray start --head`, or pass address='local' to start a Ray "
            "on this machine."
        ) from exc
    return ray


# ---------------------------------------------------------------------------------- actor
class RankActor:
    """Runs one rank on its node (a Ray actor; methods run in threads, max_concurrency>1)."""

    def __init__(self, run_id: str, rank: int) -> None:
        self.run_id = run_id
        self.rank = rank
        self.proc: subprocess.Popen | None = None
        self.dir = ""
        self.started_at = time.time()
        from gangrun.launch.local import ticks_now

        self._since_ticks = ticks_now()
        self._cv = threading.Condition()
        self._buf: dict[str, list[bytes]] = {"out": [], "err": []}
        self._open = 0
        self._code: int | None = None
        self._exited_at = 0.0
        self._live_w = -1

    def node_info(self) -> dict[str, Any]:
        import ray

        from gangrun import accelerators

        ctx = ray.get_runtime_context()
        gpu_ids = [str(g) for g in ray.get_gpu_ids()]
        names: list[str] = []
        if gpu_ids:
            try:
                names = [d.name for d in accelerators.detect()]
            except Exception:
                names = []
        return {
            "node_id": ctx.get_node_id(),
            "ip": ray.util.get_node_ip_address(),
            "hostname": os.uname().nodename,
            "gpu_ids": gpu_ids,
            "gpu_names": names,
            "cpus": os.cpu_count() or 1,
            "pid": os.getpid(),
            "cwd": os.getcwd(),
        }

    def free_port(self) -> int:
        from gangrun.platform import free_port

        return free_port("0.0.0.0")

    def start(self, payload: bytes, context: dict[str, Any], env: dict[str, str]) -> int:
        from gangrun.launch.local import _BOOT

        self.dir = tempfile.mkdtemp(prefix=f"gangrun-{self.run_id}-r{self.rank}-")
        with open(os.path.join(self.dir, "payload.pkl"), "wb") as f:
            f.write(payload)
        ctx = dict(context)
        # The caller's paths first, then this node's own (runtime_env py_modules/working_dir).
        paths = list(ctx.get("sys_path") or [])
        paths += [p for p in sys.path if p not in paths]
        ctx["sys_path"] = paths
        if context.get("use_actor_cwd") or not os.path.isdir(str(ctx.get("cwd"))):
            ctx["cwd"] = os.getcwd()
        with open(os.path.join(self.dir, "context.json"), "w") as f:
            json.dump(ctx, f)
        full = dict(os.environ)
        full.update(env)
        full["GANGRUN_RUN_DIR"] = self.dir
        live_r, self._live_w = os.pipe()
        full["GANGRUN_LIVENESS_FD"] = str(live_r)
        gangrun_parent = os.path.dirname(
            os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        )
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", _BOOT.format(path=gangrun_parent)],
                env=full,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                pass_fds=(live_r,),
                start_new_session=True,
            )
        finally:
            os.close(live_r)
        assert self.proc.stdout is not None and self.proc.stderr is not None
        self._open = 2
        for kind, pipe in (("out", self.proc.stdout), ("err", self.proc.stderr)):
            threading.Thread(target=self._read, args=(kind, pipe), daemon=True).start()
        threading.Thread(target=self._wait, daemon=True).start()
        return self.proc.pid

    def _read(self, kind: str, pipe: Any) -> None:
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
        assert self.proc is not None
        code = self.proc.wait()
        with self._cv:
            self._code = code
            self._exited_at = time.monotonic()
            self._cv.notify_all()

    def _exit_ready(self) -> bool:
        # Report the exit once the rank's output is drained (or after a second, when a
        # descendant that outlives the rank still holds its pipes).
        return self._code is not None and (
            self._open == 0 or time.monotonic() - self._exited_at > 1.0
        )

    def poll(self, timeout: float) -> dict[str, Any]:
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
            return {"out": out, "err": err, "exit": self._code if done else None}

    def files(self) -> dict[str, bytes]:
        """The rank's result/error file (whichever it wrote), then the private dir is removed."""
        from gangrun.worker import error_path, result_path

        got: dict[str, bytes] = {}
        for kind, path in (
            ("result", result_path(self.dir, self.rank)),
            ("error", error_path(self.dir, self.rank)),
        ):
            try:
                with open(path, "rb") as f:
                    got[kind] = f.read()
            except OSError:
                pass
        return got

    def stop(self, grace: float) -> int | None:
        """SIGTERM the rank's tree, wait up to ``grace``, SIGKILL what is left, sweep this node."""
        from gangrun.launch.local import _signal_tree, sweep

        p = self.proc
        if p is not None:
            if p.poll() is None:
                _signal_tree([p.pid], signal.SIGTERM)
                try:
                    p.wait(grace)
                except subprocess.TimeoutExpired:
                    pass
            _signal_tree([p.pid], signal.SIGKILL)
            try:
                p.wait(5.0)
            except subprocess.TimeoutExpired:  # pragma: no cover
                pass
        sweep(self.run_id, self._since_ticks)
        if self._live_w != -1:
            os.close(self._live_w)
            self._live_w = -1
        return None if p is None else p.returncode

    def cleanup(self) -> None:
        import shutil

        if self.dir:
            shutil.rmtree(self.dir, ignore_errors=True)


# ---------------------------------------------------------------------------------- gang
class RayGang:
    """The actors (and so the rank processes) of one attempt of one call on a Ray cluster."""

    def __init__(self, spec: GangSpec, pump: Any) -> None:
        self.spec = spec
        self.pump = pump
        self.ray = _ray()
        self.exits: queue.Queue[RankExit] = queue.Queue()
        self.pids: dict[int, int] = {}
        self.nodes: dict[int, dict[str, Any]] = {}
        self.actors: dict[int, Any] = {}
        self.pg: Any = None
        self._ended: set[int] = set()
        self._stopping = False
        self._threads: list[threading.Thread] = []
        self._logs: list[Any] = []
        self._lock = threading.Lock()
        self._closed = False

    # -- start ---------------------------------------------------------------------------
    def start(self) -> None:
        try:
            try:
                self._start()
            except self.ray.exceptions.RayError as exc:
                raise LaunchError(
                    f"Could not start the ranks' actors on the Ray cluster: {exc}\n"
                    "Is gangrun (with the same Python and torch) installed on every node? "
                    "Code can also be shipped with GANGRUN_RAY_RUNTIME_ENV, e.g. "
                    '\'{"py_modules": ["/path/to/gangrun"]}\'.'
                ) from exc
        except BaseException:
            self._stopping = True
            self._teardown(0.0)
            try:
                self.pump.close(drain_timeout=0.5)
            except Exception:
                pass
            raise

    def _start(self) -> None:
        ray = self.ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        spec = self.spec
        x = spec.extra
        n = len(spec.ranks)
        bundle = dict(x["bundle"])
        self.pg = placement_group([dict(bundle) for _ in range(n)], strategy=x["strategy"])
        wait = float(x["placement_timeout"])
        ready, _ = ray.wait([self.pg.ready()], timeout=wait)
        if not ready:
            avail = ray.available_resources()
            raise LaunchError(
                f"Ray could not reserve {n} bundle(s) of {bundle} with strategy "
                f"{x['strategy']} within {wait:g}s (available now: "
                f"{_fmt_resources(avail)}). Free resources, ask for fewer ranks, or change "
                "GANGRUN_RAY_STRATEGY."
            )
        actor_cls = ray.remote(RankActor)
        runtime_env = x.get("runtime_env") or None
        for r in range(n):
            opts: dict[str, Any] = {
                "num_cpus": bundle.get("CPU", 0),
                "num_gpus": bundle.get("GPU", 0),
                "resources": {k: v for k, v in bundle.items() if k not in ("CPU", "GPU")},
                "max_concurrency": 4,
                "max_restarts": 0,
                "scheduling_strategy": PlacementGroupSchedulingStrategy(
                    placement_group=self.pg, placement_group_bundle_index=r
                ),
            }
            if runtime_env:
                opts["runtime_env"] = runtime_env
            self.actors[r] = actor_cls.options(**opts).remote(spec.run_id, r)
        infos = ray.get([self.actors[r].node_info.remote() for r in range(n)], timeout=wait)
        self.nodes = dict(enumerate(infos))
        self._check_gpu_type()
        envs = self._rank_envs()
        with open(os.path.join(spec.run_dir, "payload.pkl"), "rb") as f:
            payload = ray.put(f.read())  # once in the object store, not once per rank
        with open(os.path.join(spec.run_dir, "context.json")) as f:
            context = json.load(f)
        context["use_actor_cwd"] = bool(runtime_env and "working_dir" in runtime_env)
        pids = ray.get(
            [self.actors[r].start.remote(payload, context, envs[r]) for r in range(n)],
            timeout=wait,
        )
        self.pids = dict(enumerate(pids))
        for r in range(n):
            log_fd = os.open(
                os.path.join(spec.log_dir, f"rank-{r}.log"),
                os.O_WRONLY | os.O_CREAT | os.O_APPEND,
                0o600,
            )
            log = os.fdopen(log_fd, "ab", buffering=0)
            self._logs.append(log)
            out_r, out_w = os.pipe()
            err_r, err_w = os.pipe()
            self.pump.add(r, "out", out_r, log)
            self.pump.add(r, "err", err_r, log)
            t = threading.Thread(
                target=self._forward,
                args=(r, out_w, err_w),
                name=f"gangrun-ray-{r}",
                daemon=True,
            )
            t.start()
            self._threads.append(t)
        self.pump.start()

    def _check_gpu_type(self) -> None:
        want = self.spec.extra.get("gpu_type")
        if not want:
            return
        from .. import accelerators

        for r, info in self.nodes.items():
            for name in info.get("gpu_names") or []:
                if not accelerators.matches_type(name, want):
                    raise LaunchError(
                        f"gpu_type={want!r} does not match the accelerator {name!r} that Ray "
                        f"gave rank {r} on node {info['ip']}."
                    )

    def _rank_envs(self) -> dict[int, dict[str, str]]:
        port = self.ray.get(self.actors[0].free_port.remote(), timeout=60)
        return node_envs(self.spec, self.nodes, int(port))

    # -- watching ------------------------------------------------------------------------
    def _forward(self, rank: int, out_w: int, err_w: int) -> None:
        ray = self.ray
        actor = self.actors[rank]
        code: int | None = None
        lost: BaseException | None = None
        try:
            while True:
                res = ray.get(actor.poll.remote(POLL_S), timeout=POLL_S + 60)
                for fd, data in ((out_w, res["out"]), (err_w, res["err"])):
                    if data:
                        _write_all(fd, data)
                if res["exit"] is not None:
                    code = int(res["exit"])
                    break
        except ray.exceptions.GetTimeoutError as exc:
            lost = exc
        except ray.exceptions.RayError as exc:
            lost = exc
        except Exception as exc:  # pragma: no cover - a bug: report the rank as failed
            lost = exc
        if code is not None:
            try:
                files = ray.get(actor.files.remote(), timeout=120)
                for kind, data in files.items():
                    _write_file(os.path.join(self.spec.run_dir, f"{kind}.{rank}.pkl"), data)
            except Exception as exc:
                if code == 0:
                    lost = exc
                    code = None
        for fd in (out_w, err_w):
            try:
                os.close(fd)
            except OSError:
                pass
        if code is None:
            if self._stopping:
                code = -signal.SIGKILL
            else:
                code = 1
                self._write_lost(rank, lost)
        with self._lock:
            self._ended.add(rank)
        self.exits.put(RankExit(rank, code, time.time()))

    def _write_lost(self, rank: int, exc: BaseException | None) -> None:
        from .. import serialization
        from ..worker import error_path

        info = self.nodes.get(rank, {})
        node = info.get("node_id", "?")
        on_node = sorted(r for r, i in self.nodes.items() if i.get("node_id") == node)
        what = type(exc).__name__ if exc is not None else "ActorDiedError"
        msg = (
            f"the Ray actor running rank {rank} on node {info.get('ip', '?')} "
            f"({str(node)[:12]}) was lost: ranks {on_node} ran on that node. "
            "The node may have died or been removed, or the actor was killed."
        )
        record = {
            "rank": rank,
            "exc_type": f"ray.{what}",
            "message": msg,
            "traceback": f"{msg}\n\nRay said: {exc}",
            "exc": None,
            "time": time.time(),
            "pid": self.pids.get(rank),
        }
        try:
            serialization.atomic_dump(record, error_path(self.spec.run_dir, rank))
        except Exception:
            pass

    def next_exit(self, timeout: float | None) -> RankExit | None:
        try:
            return self.exits.get(timeout=timeout)
        except queue.Empty:
            return None

    def alive(self) -> list[int]:
        with self._lock:
            return [r for r in self.actors if r not in self._ended]

    # -- teardown ------------------------------------------------------------------------
    def stop(self, grace: float | None = None) -> None:
        self._stopping = True
        self._teardown(self.spec.grace_period if grace is None else grace)

    def reap_leftovers(self) -> None:
        self._stopping = True
        self._teardown(0.0)

    def _teardown(self, grace: float) -> None:
        ray = self.ray
        refs = []
        for a in self.actors.values():
            try:
                refs.append(a.stop.remote(grace))
            except Exception:
                pass
        if refs:
            try:
                ray.wait(refs, num_returns=len(refs), timeout=grace + 15)
            except Exception:
                pass
        # The ranks are gone: let the forwarders drain what they wrote before the actors go.
        deadline = time.monotonic() + 5.0
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        cleanup = []
        for a in self.actors.values():
            try:
                cleanup.append(a.cleanup.remote())
            except Exception:
                pass
        if cleanup:
            try:
                ray.wait(cleanup, num_returns=len(cleanup), timeout=10)
            except Exception:
                pass
        for a in self.actors.values():
            try:
                ray.kill(a, no_restart=True)
            except Exception:
                pass
        if self.pg is not None:
            try:
                from ray.util.placement_group import remove_placement_group

                remove_placement_group(self.pg)
            except Exception:
                pass
            self.pg = None
        for t in self._threads:
            t.join(10.0)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for t in self._threads:
            t.join(2.0)
        for log in self._logs:
            try:
                log.close()
            except Exception:
                pass
        self._logs.clear()


def node_envs(
    spec: GangSpec, nodes: dict[int, dict[str, Any]], port: int
) -> dict[int, dict[str, str]]:
    """Each rank's environment from the bundle -> node mapping: ``NODE_RANK`` (rank 0's node
    is node 0, the others in order of their lowest rank), ``LOCAL_RANK`` within the node,
    ``MASTER_ADDR`` = rank 0's node, ``CUDA_VISIBLE_DEVICES`` = the gang's GPUs on the node
    in local-rank order (so ``cuda:LOCAL_RANK`` is the rank's own GPU)."""
    order: list[str] = []
    local: dict[str, list[int]] = {}
    for rs in sorted(spec.ranks, key=lambda r: r.rank):
        node = nodes[rs.rank]["node_id"]
        if node not in local:
            order.append(node)
            local[node] = []
        local[node].append(rs.rank)
    master = nodes[0]["ip"]
    user_omp = spec.extra.get("user_omp")
    envs: dict[int, dict[str, str]] = {}
    for rs in spec.ranks:
        r = rs.rank
        info = nodes[r]
        node = info["node_id"]
        peers = local[node]
        env = {k: v for k, v in rs.env.items() if k not in _NODE_LOCAL}
        env.update(
            {
                "LOCAL_RANK": str(peers.index(r)),
                "LOCAL_WORLD_SIZE": str(len(peers)),
                "NODE_RANK": str(order.index(node)),
                "GROUP_RANK": str(order.index(node)),
                "GROUP_WORLD_SIZE": str(len(order)),
                "MASTER_ADDR": master,
                "MASTER_PORT": str(port),
                "GANGRUN_RAY_NODE_ID": node,
                "GANGRUN_RAY_NODE_IP": info["ip"],
            }
        )
        if not user_omp:
            env["OMP_NUM_THREADS"] = str(max(1, int(info["cpus"]) // len(peers)))
        gpus = [g for p in peers for g in nodes[p]["gpu_ids"]]
        if gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
        envs[r] = env
    return envs


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            n = os.write(fd, view)
        except OSError:  # the pump gave up on this stream: drop the rest
            return
        view = view[n:]


def _write_file(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def _fmt_resources(res: dict[str, float]) -> str:
    keep = {k: v for k, v in res.items() if not k.startswith(("node:", "memory", "object_store"))}
    return ", ".join(f"{k}={v:g}" for k, v in sorted(keep.items())) or "nothing"


# ---------------------------------------------------------------------------------- run
def _type_matches(ray_type: str, want: str) -> bool:
    from .. import accelerators

    # Ray's names look like "H100", "A10G", "NVIDIA_H100-80GB"...
    return accelerators.matches_type(ray_type.replace("_", " "), want)


__all__ = ["RayGang", "RankActor", "connect"]
