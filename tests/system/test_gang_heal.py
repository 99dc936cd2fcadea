"""Self-healing gangs and the hang guard of executions, on this node.

The same code heals a gang on a Ray cluster: tests/system/test_ray_cluster.py.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

import gangrun
from gangrun import DistributedError

pytestmark = pytest.mark.slow


def count_setup() -> None:
    state = gangrun.rank_state()
    state["setups"] = state.get("setups", 0) + 1
    state["restored"] = 7  # what a checkpoint restore rebuilds


@pytest.mark.mlflow
def test_rank_killed_between_cells_is_healed_and_the_cell_runs(capfd):
    with gangrun.Gang(processes=2, max_restarts=1, setup=count_setup) as g:
        run_id = g.handle.mlflow_run_id
        assert run_id and g.execute("restored") == [7, 7]
        g.execute("lost = 1")
        os.kill(g.pids[1], signal.SIGKILL)
        deadline = time.monotonic() + 30
        while not g.handle.done() and time.monotonic() < deadline:  # the call noticed
            time.sleep(0.05)
        # the rank died while idle: the gang heals, re-runs setup, then runs this cell
        assert g.execute("(restored, setups, 'lost' in dir())") == [(7, 1, False)] * 2
        assert g.restarts == 1
        assert g.handle.mlflow_run_id == run_id  # one MLflow run across the restart
        err = capfd.readouterr().err
        assert "restarting every rank of the gang (restart 1 of 1) and re-running setup()" in err
        # no restart left: the next death breaks the gang, as without max_restarts
        os.kill(g.pids[0], signal.SIGKILL)
        with pytest.raises(DistributedError, match="call g.restart"):
            g.execute("import time; time.sleep(5)")


def test_quiet_executions_outside_collectives_are_no_hang():
    # the verdict is about collectives: every rank asleep (or quiet) is not a distributed hang;
    # a collective held up by a rank is (tests/reliability/test_hang_verdict.py)
    with gangrun.Gang(processes=2, hang_timeout=1.0, interrupt_grace=5.0) as g:
        g.execute("import time")
        assert g.execute("time.sleep(3)\n1") == [1, 1]
        assert g.execute("for i in range(4):\n    print(i, flush=True); time.sleep(0.5)\n1") == [
            1,
            1,
        ]
        assert g.execute("2") == [2, 2]
