"""What a new user does first (issue 24, "what a new user tripped over"): the README's plain
call, a failing script on the command line, its MLflow run's source, a first call in a kernel.
Small and real: gloo process groups, the ``gangrun`` command, a sqlite MLflow store, a kernel."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from conftest import assert_no_survivors

pytestmark = pytest.mark.slow

# The README's body, plain-called twice and then distributed (item 6).
PLAIN_TWICE = """
import json, os
from gangrun import distributed

VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK",
        "MASTER_ADDR", "MASTER_PORT")

@distributed(processes=2, mlflow=False, timeout=120)
def train(num_epochs: int, batch_size: int):
    import torch, torch.distributed as dist, gangrun
    dist.init_process_group(gangrun.backend())
    t = torch.ones(1) * (dist.get_rank() + 1)
    dist.all_reduce(t)
    # left initialised, as most training scripts do
    return [dist.get_rank(), dist.get_world_size(), t.item(), os.environ["MASTER_PORT"]]

before = {k: os.environ.get(k) for k in VARS}
first = train(1, 8)
between = {k: os.environ.get(k) for k in VARS}
second = train(1, 8)
import torch.distributed as dist
print(json.dumps({
    "first": first, "second": second, "before": before, "between": between,
    "after": {k: os.environ.get(k) for k in VARS}, "initialized": dist.is_initialized(),
    "distributed": train.distributed(1, 8),
}))
"""


def test_plain_call_is_a_world_of_one_twice(script):
    proc = script(PLAIN_TWICE)
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, err
    got = json.loads(out.strip().splitlines()[-1])
    assert got["first"][:3] == [0, 1, 1.0] and got["second"][:3] == [0, 1, 1.0]
    assert got["before"] == got["between"] == got["after"]  # restored after each call
    assert set(got["after"].values()) == {None}
    assert got["initialized"] is False  # the group the plain call left was destroyed
    assert [r[:3] for r in got["distributed"]] == [[0, 2, 3.0], [1, 2, 3.0]]
    assert_no_survivors(proc.pid)
