"""What the caller and a rank's actor exchange: frozen records, one per message.

Every actor method answers with one of these (cf. Ray Train's ``ActorMetadata`` and
``WorkerStatus``), and the caller ships the rank's context as an `ActorContext`: a field
added on one side is a field the other side sees (or a ``TypeError`` at once), never a dict
key silently dropped. They travel by pickle between processes of the same gangrun version
(checked at placement: `gangrun.launch.ray.versions`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ...wire.records import RankContext


@dataclass(frozen=True)
class NodeInfo:
    """Where an actor runs (`RankActor.node_info`): its node, its GPUs, its versions."""

    node_id: str
    ip: str
    hostname: str = ""
    gpu_ids: tuple[str, ...] = ()  # Ray's GPU ids of the actor's bundle
    gpu_names: tuple[str, ...] = ()  # the node's accelerator names (NVML), for gpu_type
    cpus: int = 1
    pid: int = 0  # the actor's process on its node
    cwd: str = ""
    versions: dict[str, str | None] = field(default_factory=dict)  # versions.local_versions

    def label(self) -> str:
        """``node 10.0.0.2 (Ray node id 1a2b...)``: how errors name the node."""
        return f"node {self.ip or '?'} (Ray node id {str(self.node_id or '?')[:16]})"


@dataclass(frozen=True)
class ShipMap:
    """Where the caller's shipped directories are (`gangrun.launch.ray.ship`): the caller's
    working directory (``""``: not shipped) and, per shipped directory, the name of its
    package (the directory Ray unpacks it into on a node)."""

    cwd: str = ""
    roots: tuple[tuple[str, str], ...] = ()  # (the caller's path, the package's name)


@dataclass(frozen=True)
class FilesIdentity:
    """Which directory a path is (`ship.files_identity`): the machine's boot id, the device
    and the inode; equal on a node that sees the caller's very directory."""

    boot: str = ""
    dev: int = -1
    ino: int = -1  # -1: the path does not exist there


@dataclass(frozen=True)
class ActorContext:
    """What the caller ships to every actor with the payload: the rank's `RankContext` as
    the caller sees it, and what the actor needs to map it onto its node."""

    rank: RankContext
    ship: ShipMap = ShipMap()  # ship.Manifest.context(); empty: nothing shipped
    caller_files: FilesIdentity | None = None  # ship.files_identity(cwd); None: unknown
    use_actor_cwd: bool = False  # Ray's runtime_env working_dir is the rank's directory


@dataclass(frozen=True)
class Started:
    """A rank running on its actor (`RankActor.start`)."""

    pid: int  # the rank's process on its node
    local: bool  # the node sees the caller's files: the rank runs in the caller's directory
    cwd: str  # the rank's working directory on its node


@dataclass(frozen=True)
class Polled:
    """New output since the last `RankActor.poll`, and the exit code once the rank ended
    and its output was drained (``None`` while it runs)."""

    out: bytes = b""
    err: bytes = b""
    exit: int | None = None


@dataclass(frozen=True)
class RankOutputs:
    """What an ended rank left on its node (`RankActor.files`): the bytes of its result or
    error file (whichever it wrote) and of its step report; ``None`` for a file it did not
    write."""

    result: bytes | None = None
    error: bytes | None = None
    progress: bytes | None = None


__all__ = [
    "NodeInfo",
    "ActorContext",
    "FilesIdentity",
    "ShipMap",
    "Started",
    "Polled",
    "RankOutputs",
]
