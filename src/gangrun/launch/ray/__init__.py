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

Knobs (environment variables, read from ``env=`` first, then the caller's environment):

- ``GANGRUN_RAY_STRATEGY``: placement strategy, ``PACK`` (default), ``SPREAD``,
  ``STRICT_PACK`` or ``STRICT_SPREAD``.
- ``GANGRUN_RAY_RUNTIME_ENV``: JSON Ray runtime env merged into the actors' (``working_dir``,
  ``py_modules``, ``pip``, ``env_vars``...), to ship code the function imports by name;
  local directories are uploaded to the cluster as ``ray.init`` does, and with a
  ``working_dir`` the ranks run in its shipped copy.
- ``GANGRUN_RAY_PLACEMENT_TIMEOUT``: seconds to wait for the bundles (default 300).
- ``GANGRUN_RAY_FORWARD_ENV``: comma-separated names of further caller variables to ship.

Modules: ``placement`` (connection, placement group, per-node environments), ``actor`` (the
rank actor), ``spawner`` (the `Spawner`). The planning (world size,
bundle, strategy, runtime env) is the lifecycle's: `gangrun.lifecycle.ray_plan`.
"""

from __future__ import annotations

from .placement import STRATEGIES, connect, fmt_resources, node_envs

__all__ = ["connect", "fmt_resources", "node_envs", "STRATEGIES"]
