"""The call's lifecycle: plan, supervise, restart, observe, and settle one call.

- `state`: states, typed events, the terminal `Outcome` record
- `plan` / `ray_plan`: side-effect-free planning (world, devices, rank env)
- `supervisor`: acquisitions, the monitor, the one teardown path
- `collect` / `rootcause`: what the ranks left, and who is to blame
- `policy`: restart or stop; `observers`: MLflow, notices, and yours
- `calls`: the active calls and the one ``atexit`` hook
"""

from __future__ import annotations

from .calls import stop_all
from .state import Outcome, State
from .supervisor import Supervisor

__all__ = ["Supervisor", "State", "Outcome", "stop_all"]
