"""Ray actors behind the `Spawner` protocol.

One call reserves one placement group bundle per rank, starts one `RankActor` per
rank inside its bundle, and each actor runs its rank on its node. A rank's handle
(`RayProcess`) forwards the rank's output from the actor into the gang's local pipes
(read by the usual output pump: ``[rank N]`` prefixes, log files) and ships its result or
error file back into the caller's run directory before its exit is reported.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Sequence
from typing import Any

from ... import settings
from ...errors import LaunchError
from ...wire import contract, serialization
from ...wire.records import ErrorRecord, RankContext
from ...wire.rundir import RunDir
from .. import GangSpec, LostRank, RankIO, RankProcess, RankSpec
from ..spawn import close_write_ends
from . import diagnose, ship, versions
from .actor import RankActor
from .placement import check_gpu_type, node_envs, placement_of, ray_module, reserve
from .records import ActorContext, NodeInfo, Polled, RankOutputs, ShipMap, Started

log = logging.getLogger("gangrun.launch.ray")
POLL_S = 2.0  # an idle rank's poll returns this often; output and exits return at once
CALLER_DEADLINE_S = 5.0  # GANGRUN_RAY_CALLER_DEADLINE: an actor's wait for the caller's beat


def caller_deadline() -> float:
    """Seconds without the caller's heartbeat after which its actors end (`RankActor`)."""
    return settings.seconds_in_force(contract.RAY_CALLER_DEADLINE, CALLER_DEADLINE_S)


def caller_node_id(ray: Any) -> str | None:
    """The Ray node this caller runs on; ``None`` for a Ray Client caller (``ray://``),
    whose driver runs on the head on its behalf: the caller is on no node of the cluster."""
    try:
        if ray.util.client.ray.is_connected():
            return None
        return str(ray.get_runtime_context().get_node_id())
    except Exception as exc:  # no node to compare with: every rank counts as elsewhere
        log.debug("the caller's Ray node: %s", exc)
        return None


def lost_actor(rank: int, nodes: dict[int, NodeInfo], exc: BaseException | None) -> LostRank:
    """The actor running ``rank`` is gone (its node died, it was killed): what the caller's
    error says of it, naming the node and every rank that ran there
    (`lifecycle.rootcause.rank_failure` makes it the rank's failure; the restart rules treat
    ``ray.*`` as transient)."""
    info = nodes.get(rank)
    node = info.node_id if info is not None else "?"
    on_node = sorted(r for r, i in nodes.items() if i.node_id == node)
    what = type(exc).__name__ if exc is not None else "ActorDiedError"
    msg = (
        f"the Ray actor running rank {rank} on node {info.ip if info else '?'} "
        f"({str(node)[:12]}) was lost: ranks {on_node} ran on that node. "
        "The node may have died or been removed, or the actor was killed."
    )
    log.info("%s", msg)
    return LostRank(msg, exc_type=f"ray.{what}", detail=f"{msg}\n\nRay said: {exc}", launcher=False)


class RayProcess:
    """One rank on a Ray actor; `wait` forwards its output until it ends."""

    def __init__(self, spawner: RaySpawner, rank: int, pid: int, io: RankIO) -> None:
        self.spawner = spawner
        self.rank = rank
        self.pid = pid
        self.out_w, self.err_w = io.out_w, io.err_w  # ours until the rank ended
        self.lost: LostRank | None = None  # set when the actor (or its node) was lost

    @property
    def node(self) -> str | None:
        """The rank's node when it is another than the caller's (`RankExit.node`)."""
        return self.spawner.nodes_elsewhere().get(self.rank)

    def signal(self, sig: int) -> None:
        if sig in (signal.SIGTERM, signal.SIGKILL):  # the gang is being stopped
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
                res: Polled = ray.get(actor.poll.remote(POLL_S), timeout=POLL_S + 60)
                for fd, data in ((self.out_w, res.out), (self.err_w, res.err)):
                    if data:
                        _write_all(fd, data)
                if res.exit is not None:
                    code = int(res.exit)
                    break
        except Exception as exc:  # RayError, a timeout: the actor (or its node) is lost
            lost = exc
        if code is not None:
            try:
                files: RankOutputs = ray.get(actor.files.remote(), timeout=120)
                rd = RunDir(self.spawner.run_dir)
                for blob, path in (
                    (files.result, rd.result(self.rank)),
                    (files.error, rd.error(self.rank)),
                    (files.progress, rd.progress(self.rank)),
                ):
                    if blob is not None:
                        _write_file(path, blob)
                if files.error is not None:
                    self.spawner.explain(self.rank, rd.error(self.rank))
            except Exception as exc:
                if code == 0:
                    lost, code = exc, None
        if code not in (0, None):
            self._name_node(code)
        for fd in (self.out_w, self.err_w):
            os.close(fd)
        self.out_w = self.err_w = -1
        if code is None:
            if self.spawner.stopping:
                return -signal.SIGKILL
            self.lost = lost_actor(self.rank, self.spawner.nodes, lost)
            info = self.spawner.nodes.get(self.rank)
            if info is not None:
                self.spawner.lost_nodes.add(info.node_id)
            return 1
        return code

    def _name_node(self, code: int) -> None:
        """A rank on another node that ended badly: say where, in its output (and so in
        the log tail the caller's error shows, for deaths without a Python exception)."""
        node = self.node
        if node is None:
            return
        note = f"gangrun: rank {self.rank} (exit {code}) ran on {node}\n"
        _write_all(self.err_w, note.encode())


class RaySpawner:
    name = "ray"

    def __init__(self, spec: GangSpec) -> None:
        self.ray = ray_module()
        self.placement = placement_of(spec)
        self.run_dir = spec.run_dir
        self.nodes: dict[int, NodeInfo] = {}
        self.lost_nodes: set[str] = set()  # nodes of ranks whose actor was lost
        self.actors: dict[int, Any] = {}
        self.pg: Any = None
        self.stopping = False
        self.manifest: ship.Manifest | None = None
        self.uploaded = ship.Uploaded()  # what this gang's start sent to the cluster
        self.started: dict[int, Started] = {}
        self.caller_cwd = ""
        self.caller_node: str | None = None  # the caller's Ray node id (None: Ray Client)
        self._beating = threading.Event()  # set: the heartbeat stops

    def _heartbeat(self, every: float) -> None:
        """Tell every actor that the caller lives, through the Ray connection (so also
        under Ray Client, with no other path between the nodes and the caller)."""
        while not self._beating.wait(every):
            for a in list(self.actors.values()):
                try:
                    a.beat.remote()
                except Exception as exc:  # the actor (or the connection) is gone
                    log.debug("heartbeat to an actor: %s", exc)

    def start(self, spec: GangSpec, ranks: Sequence[tuple[RankSpec, RankIO]]) -> list[RankProcess]:
        try:
            try:
                return self._start(spec, ranks)
            except self.ray.exceptions.RayError as exc:
                raise LaunchError(
                    f"Could not start the ranks' actors on the Ray cluster: {exc}\n"
                    "Is gangrun (with the same Python and torch) installed on every node? "
                    "Packages can be installed by Ray: ray=gangrun.RayOptions(pip=[...])."
                ) from exc
        except BaseException:
            close_write_ends(ranks)
            self.release(0.0)
            raise

    def _ship(self, context: RankContext, payload: bytes, runtime_env: dict[str, Any]) -> ShipMap:
        """Ship the caller's files the ranks may need (`ship`); sets the actors'
        ``py_modules``; the map the actors translate paths with (empty: nothing shipped)."""
        opts = self.placement.shipping
        if opts is None or not opts.ship:
            return ShipMap()
        cwd, sys_path = context.cwd, list(context.sys_path)
        extra = [os.path.abspath(os.path.expanduser(p)) for p in opts.paths]
        for p in extra:
            if not os.path.isdir(p):
                raise LaunchError(f"ray=RayOptions(paths=[{p!r}]): not a directory here.")
        extra += ship.module_roots(ship.pickled_modules(payload), sys_path, cwd)
        with_cwd = "working_dir" not in runtime_env
        manifest, scanned = ship.build(
            cwd if with_cwd else None, extra, opts.excludes, opts.max_ship_bytes
        )
        self.uploaded = ship.upload(manifest, scanned)
        if manifest.roots:
            mods = list(runtime_env.get("py_modules") or [])
            runtime_env["py_modules"] = mods + [r.uri for r in manifest.roots]
        self.manifest = manifest
        return manifest.context()

    def _start(self, spec: GangSpec, ranks: Sequence[tuple[RankSpec, RankIO]]) -> list[RankProcess]:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        ray, pl = self.ray, self.placement
        n = len(ranks)
        rd = RunDir(spec.run_dir)
        with open(rd.payload, "rb") as f:
            payload_bytes = f.read()
        with open(rd.context) as f:
            rank_context = RankContext.from_json(f.read())
        runtime_env = dict(pl.runtime_env or {})
        shipped = self._ship(rank_context, payload_bytes, runtime_env)
        self.caller_cwd = rank_context.cwd
        context = ActorContext(
            rank=rank_context,
            ship=shipped,
            caller_files=ship.files_identity(self.caller_cwd),
            use_actor_cwd="working_dir" in runtime_env,
        )
        self.caller_node = caller_node_id(ray)
        self.pg = reserve(ray, pl, n)
        actor_cls = ray.remote(RankActor)
        deadline = caller_deadline()
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
            if runtime_env:
                opts["runtime_env"] = runtime_env
            self.actors[r] = actor_cls.options(**opts).remote(spec.run_id, r, deadline)
        threading.Thread(
            target=self._heartbeat,
            args=(min(1.0, deadline / 5),),
            name="gangrun-ray-heartbeat",
            daemon=True,
        ).start()
        wait = pl.placement_timeout
        infos = ray.get([self.actors[r].node_info.remote() for r in range(n)], timeout=wait)
        self.nodes = dict(enumerate(infos))
        versions.check(self.nodes)
        check_gpu_type(pl.gpu_type, self.nodes)
        port = int(ray.get(self.actors[0].free_port.remote(), timeout=60))
        envs = node_envs([r for r, _ in ranks], self.nodes, port, pl.user_omp)
        payload = ray.put(payload_bytes)  # once in the object store, not once per rank
        started = ray.get(
            [self.actors[r].start.remote(payload, context, envs[r]) for r in range(n)],
            timeout=wait,
        )
        self.started = dict(enumerate(started))
        return [
            RayProcess(self, r.rank, st.pid, io) for (r, io), st in zip(ranks, started, strict=True)
        ]

    def nodes_elsewhere(self) -> dict[int, str]:
        """The ranks on another node than the caller's, with their node as errors name it.
        Another node: not the caller's Ray node (every node, for a Ray Client caller), or a
        node that does not see the caller's files."""
        out: dict[int, str] = {}
        for r, info in self.nodes.items():
            st = self.started.get(r)
            if info.node_id != self.caller_node or (st is not None and not st.local):
                out[r] = diagnose.node_label(info)
        return out

    def explain(self, rank: int, path: str) -> None:
        """Rewrite a remote rank's error record to name its node and the fix (`diagnose`)."""
        st = self.started.get(rank)
        if st is None or st.local:
            return
        try:
            rec = serialization.load_path(path)
            if not isinstance(rec, ErrorRecord):
                return
            shipping = self.placement.shipping is not None and self.placement.shipping.ship
            rec = diagnose.explain(
                rec,
                self.nodes.get(rank),
                self.manifest,
                shipping,
                self.caller_cwd,
                st.cwd,
            )
            serialization.atomic_dump(rec, path)
        except Exception as exc:  # the plain record is still the rank's error
            log.debug("explaining rank %d's error: %s", rank, exc)

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
        self._beating.set()
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
