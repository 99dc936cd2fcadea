"""The call's lifecycle: plan, supervise, restart, observe, and settle one call.

- :mod:`.state`: states, typed events, the terminal :class:`~.state.Outcome` record
- :mod:`.plan` / :mod:`.ray_plan`: side-effect-free planning (world, devices, rank env)
- :mod:`.supervisor`: acquisitions, the monitor, the one teardown path
- :mod:`.collect` / :mod:`.rootcause`: what the ranks left, and who is to blame
- :mod:`.policy`: restart or stop; :mod:`.observers`: MLflow, notices, and yours
- :mod:`.calls`: the active calls and the one ``atexit`` hook
"""

from __future__ import annotations

from .calls import stop_all
from .state import Outcome, State
from .supervisor import Supervisor

__all__ = ["Supervisor", "State", "Outcome", "stop_all"]
