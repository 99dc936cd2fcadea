"""Ranks on a Ray cluster: ``backend="ray"``.

Ray is the engine; gangrun does not schedule nodes itself. One call reserves one placement
group bundle per rank (``{"GPU": 1}`` for ``gpus=``, ``{"CPU": 1}`` for ``processes=``; PACK
by default), starts one small actor per rank inside its bundle (`actor`), and each actor
runs its rank as the spawn launcher does. The caller's side is the usual gang over a
`RaySpawner`: rank output is forwarded from the actors into local pipes read
by the output pump, and each rank's result or error file is shipped back into the caller's run
directory before its exit is reported. Everything after that (results, root cause, timeout,
cancel, interrupt, MLflow, restarts) is the lifecycle's shared code.

Connection: ``address=`` or ``RAY_ADDRESS``; with neither, an already running local cluster
is joined (``ray.init(address="auto")``); ``address="local"`` starts a private Ray on this
machine for the call's process. If the caller already called ``ray.init`` that connection is
used as is.

What reaches the nodes is the option group [`gangrun.RayOptions`][gangrun.options.RayOptions] (``ray=``): by default
the caller's working directory and the local ``sys.path`` entries of the function's modules
are shipped (`ship`), Ray's ``pip``/``env_vars``/other runtime env keys are merged in
(``GANGRUN_RAY_RUNTIME_ENV`` is the default of ``runtime_env``). At placement each node's
Python, gangrun and torch versions are checked (`versions`); a remote rank's failure
names its node and, for a missing module or file, the fix (`diagnose`).

Knobs (environment variables, read from ``env=`` first, then the caller's environment):

- ``GANGRUN_RAY_STRATEGY``: placement strategy, ``PACK`` (default), ``SPREAD``,
  ``STRICT_PACK`` or ``STRICT_SPREAD``.
- ``GANGRUN_RAY_PLACEMENT_TIMEOUT``: seconds to wait for the bundles (default 300).
- ``GANGRUN_RAY_FORWARD_ENV``: comma-separated names of further caller variables to ship.

Modules: ``placement`` (connection, placement group, per-node environments), ``actor`` (the
rank actor), ``spawner`` (the `Spawner`), ``ship``, ``versions``,
``diagnose``. The planning (world size,
bundle, strategy, runtime env) is the lifecycle's: `gangrun.lifecycle.ray_plan`.
"""

from __future__ import annotations

from .placement import STRATEGIES, connect, fmt_resources, node_envs

__all__ = ["connect", "fmt_resources", "node_envs", "STRATEGIES"]
