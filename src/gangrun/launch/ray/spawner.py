"""Ray actors behind the `Spawner` protocol.

One call reserves one placement group bundle per rank, starts one `RankActor` per
rank inside its bundle, and each actor runs its rank on its node. A rank's handle
(`RayProcess`) forwards the rank's output from the actor into the gang's local pipes
(read by the usual output pump: ``[rank N]`` prefixes, log files) and ships its result or
error file back into the caller's run directory before its exit is reported.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from collections.abc import Sequence
from typing import Any

from ... import serialization
from ...errors import LaunchError
from ...rundir import RunDir
from .. import GangSpec, RankIO, RankProcess, RankSpec
from ..spawn import close_write_ends
from .actor import RankActor
from .placement import check_gpu_type, node_envs, placement_of, ray_module, reserve

log = logging.getLogger("gangrun.launch.ray")
POLL_S = 2.0  # an idle rank's poll returns this often; output and exits return at once


class RayProcess:
    """One rank on a Ray actor; `wait` forwards its output until it ends."""

    def __init__(self, spawner: RaySpawner, rank: int, pid: int, io: RankIO) -> None:
        self.spawner = spawner
        self.rank = rank
        self.pid = pid
        self.out_w, self.err_w = io.out_w, io.err_w  # ours until the rank ended

    def signal(self, sig: int) -> None:
        self.spawner.stopping = True
        try:
            ref = self.spawner.actors[self.rank].signal.remote(sig)
            if sig == signal.SIGKILL:  # the node's sweep is done when we go on
                self.spawner.ray.get(ref, timeout=30)
        except Exception as exc:  # the actor is gone: so is its rank
            log.debug("signalling rank %d's actor: %s", self.rank, exc)

    def wait(self) -> int:
        ray = self.spawner.ray
        actor = self.spawner.actors[self.rank]
        code: int | None = None
        lost: BaseException | None = None
        try:
            while True:
                res = ray.get(actor.poll.remote(POLL_S), timeout=POLL_S + 60)
                for fd, data in ((self.out_w, res["out"]), (self.err_w, res["err"])):
                    if data:
                        _write_all(fd, data)
                if res["exit"] is not None:
                    code = int(res["exit"])
                    break
        except Exception as exc:  # RayError, a timeout: the actor (or its node) is lost
            lost = exc
        if code is not None:
            try:
                files = ray.get(actor.files.remote(), timeout=120)
                rd = RunDir(self.spawner.run_dir)
                paths = {"result": rd.result, "error": rd.error, "progress": rd.progress}
                for kind, data in files.items():
                    _write_file(paths[kind](self.rank), data)
            except Exception as exc:
                if code == 0:
                    lost, code = exc, None
        for fd in (self.out_w, self.err_w):
            os.close(fd)
        self.out_w = self.err_w = -1
        if code is None:
            if self.spawner.stopping:
                return -signal.SIGKILL
            self._write_lost(lost)
            return 1
        return code

    def _write_lost(self, exc: BaseException | None) -> None:
        nodes = self.spawner.nodes
        info = nodes.get(self.rank, {})
        node = info.get("node_id", "?")
        on_node = sorted(r for r, i in nodes.items() if i.get("node_id") == node)
        what = type(exc).__name__ if exc is not None else "ActorDiedError"
        msg = (
            f"the Ray actor running rank {self.rank} on node {info.get('ip', '?')} "
            f"({str(node)[:12]}) was lost: ranks {on_node} ran on that node. "
            "The node may have died or been removed, or the actor was killed."
        )
        record = {
            "rank": self.rank,
            "exc_type": f"ray.{what}",
            "message": msg,
            "traceback": f"{msg}\n\nRay said: {exc}",
            "exc": None,
            "time": time.time(),
            "pid": self.pid,
        }
        try:
            serialization.atomic_dump(record, RunDir(self.spawner.run_dir).error(self.rank))
        except Exception as err:  # the run directory is gone: the exit code still tells
            log.warning("could not record rank %d's loss: %s", self.rank, err)


class RaySpawner:
    name = "ray"

    def __init__(self, spec: GangSpec) -> None:
        self.ray = ray_module()
        self.placement = placement_of(spec)
        self.run_dir = spec.run_dir
        self.nodes: dict[int, dict[str, Any]] = {}
        self.actors: dict[int, Any] = {}
        self.pg: Any = None
        self.stopping = False

    def start(self, spec: GangSpec, ranks: Sequence[tuple[RankSpec, RankIO]]) -> list[RankProcess]:
        try:
            try:
                return self._start(spec, ranks)
            except self.ray.exceptions.RayError as exc:
                raise LaunchError(
                    f"Could not start the ranks' actors on the Ray cluster: {exc}\n"
                    "Is gangrun (with the same Python and torch) installed on every node? "
                    "Code can also be shipped with GANGRUN_RAY_RUNTIME_ENV, e.g. "
                    '\'{"py_modules": ["/path/to/gangrun"]}\'.'
                ) from exc
        except BaseException:
            close_write_ends(ranks)
            self.release(0.0)
            raise

    def _start(self, spec: GangSpec, ranks: Sequence[tuple[RankSpec, RankIO]]) -> list[RankProcess]:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        ray, pl = self.ray, self.placement
        n = len(ranks)
        self.pg = reserve(ray, pl, n)
        actor_cls = ray.remote(RankActor)
        for r in range(n):
            opts: dict[str, Any] = {
                "num_cpus": pl.bundle.get("CPU", 0),
                "num_gpus": pl.bundle.get("GPU", 0),
                "resources": {k: v for k, v in pl.bundle.items() if k not in ("CPU", "GPU")},
                "max_concurrency": 4,
                "max_restarts": 0,
                "scheduling_strategy": PlacementGroupSchedulingStrategy(
                    placement_group=self.pg, placement_group_bundle_index=r
                ),
            }
            if pl.runtime_env:
                opts["runtime_env"] = pl.runtime_env
            self.actors[r] = actor_cls.options(**opts).remote(spec.run_id, r)
        wait = pl.placement_timeout
        infos = ray.get([self.actors[r].node_info.remote() for r in range(n)], timeout=wait)
        self.nodes = dict(enumerate(infos))
        check_gpu_type(pl.gpu_type, self.nodes)
        port = int(ray.get(self.actors[0].free_port.remote(), timeout=60))
        envs = node_envs([r for r, _ in ranks], self.nodes, port, pl.user_omp)
        rd = RunDir(spec.run_dir)
        with open(rd.payload, "rb") as f:
            payload = ray.put(f.read())  # once in the object store, not once per rank
        with open(rd.context) as f:
            context = json.load(f)
        context["use_actor_cwd"] = bool(pl.runtime_env and "working_dir" in pl.runtime_env)
        pids = ray.get(
            [self.actors[r].start.remote(payload, context, envs[r]) for r in range(n)],
            timeout=wait,
        )
        return [
            RayProcess(self, r.rank, int(pid), io) for (r, io), pid in zip(ranks, pids, strict=True)
        ]

    def release(self, grace: float) -> None:
        """Remove every actor's directory, kill the actors, give the bundles back."""
        ray = self.ray
        refs = []
        for a in self.actors.values():
            try:
                refs.append(a.cleanup.remote())
            except Exception as exc:  # the actor is gone: its janitor removed its directory
                log.debug("actor cleanup: %s", exc)
        if refs:
            try:
                ray.wait(refs, num_returns=len(refs), timeout=grace + 15)
            except Exception as exc:  # the cluster is going away: nothing left to wait for
                log.debug("waiting for the actors' cleanup: %s", exc)
        for a in self.actors.values():
            try:
                ray.kill(a, no_restart=True)
            except Exception as exc:  # already dead
                log.debug("ray.kill: %s", exc)
        self.actors = {}
        if self.pg is not None:
            try:
                from ray.util.placement_group import remove_placement_group

                remove_placement_group(self.pg)
            except Exception as exc:  # removed with the cluster
                log.debug("removing the placement group: %s", exc)
            self.pg = None


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
