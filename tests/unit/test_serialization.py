"""The serialization boundary: checks before launch name what is wrong."""

from __future__ import annotations

import threading

import pytest

from gangrun import LaunchError
from gangrun.wire import serialization

BIG = b"x" * (3 << 20)


def uses_big() -> int:
    return len(BIG)


def test_roundtrip(tmp_path):
    p = tmp_path / "payload.pkl"
    n = serialization.write_payload(str(p), lambda a, b=2: a + b, (1,), {"b": 5})
    assert n == p.stat().st_size
    fn, args, kwargs = serialization.load_path(str(p))
    assert fn(*args, **kwargs) == 6
    assert oct(p.stat().st_mode & 0o777) == "0o600"


def test_unpicklable_argument_is_named(tmp_path):
    lock = threading.Lock()
    with pytest.raises(LaunchError, match=r"argument 'lock' \(a _thread.lock\)"):
        serialization.write_payload(str(tmp_path / "p"), lambda lock: 1, (), {"lock": lock})


def test_unpicklable_closure_is_named(tmp_path):
    lock = threading.Lock()

    def f():
        return lock

    with pytest.raises(LaunchError, match=r"closure variable 'lock'"):
        serialization.write_payload(str(tmp_path / "p"), f, (), {})


def test_capture_over_limit_names_largest(tmp_path):
    with pytest.raises(LaunchError) as ei:
        serialization.write_payload(
            str(tmp_path / "p"), uses_big, (b"y" * 1000, b"w" * (3 << 20)), {}, max_bytes=1 << 20
        )
    msg = str(ei.value)
    assert "max_capture_bytes" in msg and "Load data inside the function" in msg
    # by reference: uses_big lives in an importable module, so BIG is not captured;
    # the largest captured object is then the argument.
    assert "positional argument 1 (bytes, 3.0 MiB)" in msg


def test_capture_over_limit_closure(tmp_path):
    data = b"z" * (2 << 20)

    def f():
        return len(data)

    with pytest.raises(LaunchError, match=r"closure variable 'data' .*2\.0 MiB"):
        serialization.write_payload(str(tmp_path / "p"), f, (), {}, max_bytes=1 << 20)


def test_atomic_dump(tmp_path):
    p = tmp_path / "r.pkl"
    serialization.atomic_dump({"a": 1}, str(p))
    assert serialization.load_path(str(p)) == {"a": 1}
    assert [x.name for x in tmp_path.iterdir()] == ["r.pkl"]


def test_human_bytes():
    assert serialization.human_bytes(512) == "512 B"
    assert serialization.human_bytes(3 << 30) == "3.0 GiB"


def test_result_file_roundtrip_with_tensors_out_of_band(tmp_path):
    import numpy as np
    import torch

    big = torch.arange(100_000, dtype=torch.float32).reshape(100, 1000)
    half = torch.ones(70_000, dtype=torch.bfloat16)
    param = torch.nn.Parameter(torch.randn(200, 200))
    view = big[:, :10]  # a view: not out of band, torch's own pickling
    small = torch.ones(3)
    arr = np.arange(50_000, dtype=np.int64)
    obj = {"big": big, "half": half, "p": param, "view": view, "small": small, "arr": arr}
    obj["again"] = big  # identity kept
    p = tmp_path / "r.pkl"
    serialization.atomic_dump(obj, str(p))
    assert p.read_bytes().startswith(serialization.MAGIC)
    back = serialization.load_path(str(p))
    assert torch.equal(back["big"], big) and back["big"].shape == (100, 1000)
    assert back["half"].dtype == torch.bfloat16 and torch.equal(back["half"], half)
    assert isinstance(back["p"], torch.Tensor) and back["p"].requires_grad
    assert torch.equal(back["p"].detach(), param.detach())
    assert torch.equal(back["view"], view) and torch.equal(back["small"], small)
    assert np.array_equal(back["arr"], arr)
    assert back["again"] is back["big"]
    back["big"][0, 0] = -1.0  # writable, owned memory
    # the file is about the size of the data: no copies inside the pickle stream (the view
    # goes through torch's own pickling, which carries its whole storage: big.nbytes again)
    data_bytes = big.nbytes + half.nbytes + param.nbytes + arr.nbytes + big.nbytes
    assert p.stat().st_size < data_bytes + (1 << 16)


def test_plain_pickle_files_still_load(tmp_path):
    import pickle

    p = tmp_path / "old.pkl"
    p.write_bytes(pickle.dumps({"x": 1}))
    assert serialization.load_path(str(p)) == {"x": 1}
