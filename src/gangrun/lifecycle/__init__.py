"""The call's lifecycle: plan, supervise, restart, observe, and settle one call.

- `record`: the call's frozen `CallRecord` (identity, plan, options, streams)
- `state`: states, typed events, the terminal `Outcome` record
- `plan` / `ray_plan`: side-effect-free planning (world, devices, rank env)
- `supervisor`: acquisitions, the monitor, the one teardown path
- `collect` / `rootcause`: what the ranks left, and who is to blame
- `policy`: restart or stop; `observers`: the one typed `Observer` protocol (MLflow's end,
  notices, the panel, and yours: all handed over when the supervisor is made)
- `calls`: the active calls and the one ``atexit`` hook
"""

from __future__ import annotations

from .calls import stop_all
from .state import Outcome, State
from .supervisor import Supervisor

__all__ = ["Supervisor", "State", "Outcome", "stop_all"]
