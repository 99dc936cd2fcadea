"""Argument splitting and exit codes of the ``gangrun`` command."""

from __future__ import annotations

import pytest

from gangrun.cli import _split_run, exit_code_for
from gangrun.errors import (
    DistributedCancelledError,
    DistributedError,
    DistributedTimeoutError,
    LaunchError,
)


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (
            ["--processes", "2", "train.py", "--lr", "1"],
            (["--processes", "2"], ["train.py", "--lr", "1"], None),
        ),
        (
            ["--no-mlflow", "train.py", "--gpus", "3"],
            (["--no-mlflow"], ["train.py", "--gpus", "3"], None),
        ),
        (["--processes=2", "-m", "pkg.mod", "-x"], (["--processes=2"], ["-x"], "pkg.mod")),
        (["-mpkg.mod", "a"], ([], ["a"], "pkg.mod")),
        (["--env", "A=1", "--", "-weird.py"], (["--env", "A=1"], ["-weird.py"], None)),
    ],
)
def test_split_run(args, expected):
    assert _split_run(args) == expected


def test_exit_codes():
    assert exit_code_for(DistributedError("x", rank=1, exitcode=3)) == 3
    assert exit_code_for(DistributedError("x", rank=1, exitcode=-9)) == 137
    assert exit_code_for(DistributedError("x", rank=1, exitcode=256)) == 1
    assert exit_code_for(DistributedTimeoutError("t")) == 124
    assert exit_code_for(DistributedCancelledError("c")) == 130
    assert exit_code_for(LaunchError("l")) == 2
    assert exit_code_for(RuntimeError("?")) == 1
