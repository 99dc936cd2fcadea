"""gangrun.compat.frameworks without starting anything: the variables it derives."""

from __future__ import annotations

from conftest import run_python
from gangrun.compat.frameworks import deepspeed_env


def test_deepspeed_env_from_torchrun_variables():
    env = {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}
    env |= {"GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2", "NODE_RANK": "1"}
    assert deepspeed_env(env) == {"LOCAL_SIZE": "2", "CROSS_RANK": "1", "CROSS_SIZE": "2"}


def test_deepspeed_env_keeps_what_is_set_and_derives_node_count():
    env = {"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4", "NODE_RANK": "0", "LOCAL_SIZE": "7"}
    assert deepspeed_env(env) == {"CROSS_RANK": "0", "CROSS_SIZE": "2"}
    assert deepspeed_env({}) == {}


def test_importing_the_helpers_imports_no_framework():
    code = (
        "import sys, gangrun.compat.frameworks\n"
        "bad = {'torch', 'deepspeed', 'mlflow', 'ray'} & set(sys.modules)\n"
        "assert not bad, bad\n"
    )
    run_python(code, check=True)
