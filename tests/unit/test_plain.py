"""A plain call of a decorated function is rank 0 of a world of one;
the process group part, with real gloo, is tests/system/test_first_steps.py."""

from __future__ import annotations

import os

import pytest

from gangrun import distributed
from gangrun.plain import WORLD_OF_ONE

VARS = (*WORLD_OF_ONE, "MASTER_PORT")


@pytest.fixture
def clean_env(monkeypatch):
    for k in VARS:
        monkeypatch.delenv(k, raising=False)


def _env():
    return {k: os.environ.get(k) for k in VARS}


def test_variables_for_the_call_only_even_when_it_raises(clean_env):
    @distributed(processes=2)
    def f(fail: bool):
        if fail:
            raise ValueError("boom")
        return _env()

    seen = f(False)
    assert {k: seen[k] for k in WORLD_OF_ONE} == WORLD_OF_ONE
    assert 0 < int(seen["MASTER_PORT"]) < 65536
    assert set(_env().values()) == {None}
    with pytest.raises(ValueError, match="boom"):
        f(True)
    assert set(_env().values()) == {None}


def test_nested_plain_calls_share_the_outer_world(clean_env):
    @distributed(processes=2)
    def inner():
        return os.environ["MASTER_PORT"]

    @distributed(processes=2)
    def outer():
        return os.environ["MASTER_PORT"], inner(), os.environ.get("MASTER_PORT")

    a, b, c = outer()
    assert a == b == c
    assert os.environ.get("MASTER_PORT") is None


def test_inside_an_existing_world_nothing_changes(clean_env, monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("MASTER_PORT", "29500")

    @distributed(processes=2)
    def f():
        return _env()

    seen = f()
    assert seen["RANK"] == "3" and seen["WORLD_SIZE"] == "4" and seen["LOCAL_RANK"] is None
    assert _env() == seen


def test_a_value_the_user_set_is_kept(clean_env, monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.7")

    @distributed(processes=2)
    def f():
        os.environ["LOCAL_RANK"] = "5"  # changed by the function: not ours to remove
        return os.environ["MASTER_ADDR"], os.environ["RANK"]

    assert f() == ("10.0.0.7", "0")
    assert os.environ["MASTER_ADDR"] == "10.0.0.7" and os.environ.get("RANK") is None
    assert os.environ.pop("LOCAL_RANK") == "5"
