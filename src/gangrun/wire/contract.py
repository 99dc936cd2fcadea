"""The caller <-> rank contract: every ``GANGRUN_*`` environment variable in one place.

Set by the caller for each rank (read by the rank side, `gangrun.rank.worker`):

==============================  ==========================================================
``GANGRUN_RUN_ID``              the call's id; also the marker the teardown sweep looks
                                for in ``/proc/PID/environ`` (descendants that left the
                                rank's process group are found by it)
``GANGRUN_RUN_DIR``             the private (0700) run directory (`gangrun.wire.rundir.RunDir`)
``GANGRUN_CALLER_PID``          the caller's pid (diagnostics)
``GANGRUN_LIVENESS_FD``         fd of the read end of the caller's liveness pipe: EOF means
                                the caller died, and the rank kills its own tree
``GANGRUN_HANG_TIMEOUT``        seconds or ``auto``; when set (the hang verdict on), the
                                rank's `gangrun.heartbeat` touches its file
                                (`gangrun.rank.heartbeat`)
``GANGRUN_CALL_CHECKPOINT_DIR``  where the call's checkpoints live (the resolved
                                ``checkpoint_dir`` option, or the one the resumed MLflow run
                                recorded): `gangrun.Checkpointer` saves and restores
                                there. Not ``GANGRUN_CHECKPOINT_DIR``: that one defaults the
                                option in the caller (`gangrun.defaults`)
``GANGRUN_CALL_MEMORY_DIR``     the call's memory snapshot directory in ``/dev/shm``
                                (its keeper's: `gangrun.host.keeper`); unset: no memory
                                snapshots (`gangrun.rank.snapshots`)
``GANGRUN_CALL_MEMORY_EVERY``   the ``memory_every`` option (``0``: the adaptive interval)
``GANGRUN_CALL_MEMORY_CAP``     bytes every rank's two snapshot slots may take together
``GANGRUN_RAY_NODE_ID``         Ray backend: the node the rank's actor was placed on
``GANGRUN_RAY_NODE_IP``         Ray backend: that node's IP address
==============================  ==========================================================

Read by the caller. Every option of ``@distributed`` (a field of `gangrun.Options`) is
defaulted by ``GANGRUN_<OPTION>`` (`option_var`, read in one place: `gangrun.defaults`), e.g.
``GANGRUN_START_METHOD`` (``auto``: fork server when usable, ``spawn``, ``forkserver``) or
``GANGRUN_CHECKPOINT_DIR``. The fields of the option groups have variables of their own, read
there too, once per call, as the fields' defaults (``gangrun info`` shows each one's source):

==================================  ======================================================
``GANGRUN_PRELOAD``                 ``Options.forkserver.preload``: modules the fork server
                                    imports (default ``torch``; comma separated; ``none``)
``GANGRUN_FORKSERVER_START_TIMEOUT``  ``Options.forkserver.start_timeout``: seconds to wait
                                    for the fork server's start (300)
``GANGRUN_RAY_STRATEGY``            ``Options.ray.strategy``: placement group strategy
                                    (``PACK``, ``SPREAD``, ``STRICT_PACK``, ``STRICT_SPREAD``)
``GANGRUN_RAY_RUNTIME_ENV``         ``Options.ray.runtime_env``: JSON runtime env for the
                                    rank actors
``GANGRUN_RAY_PLACEMENT_TIMEOUT``   ``Options.ray.placement_timeout``: seconds to wait for
                                    the placement group (300)
``GANGRUN_RAY_FORWARD_ENV``         ``Options.ray.forward_env``: comma-separated caller
                                    variables shipped to Ray ranks
==================================  ======================================================

Process settings of the caller (not per call; ``gangrun info`` shows them, `SETTINGS`):

==================================  ======================================================
``GANGRUN_CACHE_DIR``               `gangrun.data`'s local file cache
``GANGRUN_SLOW_AFTER``              seconds a rank's step rate must stay under 0.8x the
                                    others' median before it is marked slow (60)
``GANGRUN_SILENT_AFTER``            seconds without any progress (output, heartbeat, step
                                    report) before a rank is marked silent (120)
``GANGRUN_LOG_LEVEL``               gangrun's own diagnostics (`gangrun._log`);
                                    ``DEBUG`` narrates each call's lifecycle
``GANGRUN_TRACKING_TIMEOUT``        seconds one tracking step of the caller may take
                                    (create/resume the run, finish it; default 60):
                                    past it the call goes on, untracked or unfinished
``GANGRUN_RAY_CALLER_DEADLINE``     Ray backend: seconds without the caller's heartbeat
                                    after which a rank's actor ends the rank and itself
                                    (default 5): the caller died, however it was connected
``GANGRUN_GANG_HOST``               Ray backend: the address a `Gang`'s ranks connect back
                                    to (default ``auto``: this machine's address as Ray
                                    sees it); set it when the nodes reach this machine
                                    under another address (NAT, a forwarded port's host)
==================================  ======================================================

Internal to the fork server: ``GANGRUN_ENVIRON_PAD`` (32 KiB of room in the server's environ
block that a forked rank overwrites with its own environment, ``GANGRUN_*`` first, so
``/proc/PID/environ`` shows it; variables beyond that room are missing from that view only,
never from the rank's ``os.environ``). Every start method refuses, before anything starts, an
environment the kernel would not exec (one variable over 128 KiB, or the whole over
``ARG_MAX``): `gangrun.launch.limits`.
"""

from __future__ import annotations

PREFIX = "GANGRUN_"  # every variable of gangrun's starts with it

RUN_ID = "GANGRUN_RUN_ID"
RUN_DIR = "GANGRUN_RUN_DIR"
CALLER_PID = "GANGRUN_CALLER_PID"
LIVENESS_FD = "GANGRUN_LIVENESS_FD"
HANG_TIMEOUT = "GANGRUN_HANG_TIMEOUT"
CHECKPOINT_DIR = "GANGRUN_CALL_CHECKPOINT_DIR"
MEMORY_DIR = "GANGRUN_CALL_MEMORY_DIR"
MEMORY_EVERY = "GANGRUN_CALL_MEMORY_EVERY"
MEMORY_CAP = "GANGRUN_CALL_MEMORY_CAP"
RAY_NODE_ID = "GANGRUN_RAY_NODE_ID"
RAY_NODE_IP = "GANGRUN_RAY_NODE_IP"

START_METHOD = "GANGRUN_START_METHOD"  # the option start_method's variable
CHECKPOINT_DIR_OPTION = "GANGRUN_CHECKPOINT_DIR"  # the option checkpoint_dir's variable
PRELOAD = "GANGRUN_PRELOAD"
FORKSERVER_START_TIMEOUT = "GANGRUN_FORKSERVER_START_TIMEOUT"
RAY_STRATEGY = "GANGRUN_RAY_STRATEGY"
RAY_RUNTIME_ENV = "GANGRUN_RAY_RUNTIME_ENV"
RAY_PLACEMENT_TIMEOUT = "GANGRUN_RAY_PLACEMENT_TIMEOUT"
RAY_FORWARD_ENV = "GANGRUN_RAY_FORWARD_ENV"
CACHE_DIR = "GANGRUN_CACHE_DIR"
SLOW_AFTER = "GANGRUN_SLOW_AFTER"
SILENT_AFTER = "GANGRUN_SILENT_AFTER"
LOG_LEVEL = "GANGRUN_LOG_LEVEL"
TRACKING_TIMEOUT = "GANGRUN_TRACKING_TIMEOUT"
RAY_CALLER_DEADLINE = "GANGRUN_RAY_CALLER_DEADLINE"
GANG_HOST = "GANGRUN_GANG_HOST"
ENVIRON_PAD = "GANGRUN_ENVIRON_PAD"

# Process settings (the second table): variable -> (built-in default, what it sets).
SETTINGS: dict[str, tuple[str, str]] = {
    CACHE_DIR: ("~/.cache/gangrun/data", "gangrun.data's local file cache"),
    SLOW_AFTER: ("60", "seconds under 0.8x the median step rate before a rank is slow"),
    SILENT_AFTER: ("120", "seconds without any progress before a rank is silent"),
    LOG_LEVEL: ("WARNING", "gangrun's own diagnostics on stderr (DEBUG narrates calls)"),
    TRACKING_TIMEOUT: ("60", "seconds one tracking step of the caller may take"),
    RAY_CALLER_DEADLINE: ("5", "seconds without the caller's heartbeat before Ray ranks end"),
    GANG_HOST: ("auto", "the address a Ray gang's ranks connect back to (auto: Ray's)"),
}


def option_var(name: str) -> str:
    """The environment variable that defaults option ``name``: ``GANGRUN_<NAME>``."""
    return PREFIX + name.upper()


def ours(name: str) -> bool:
    """Whether the environment variable ``name`` is one of gangrun's (``GANGRUN_*``)."""
    return name.startswith(PREFIX)
