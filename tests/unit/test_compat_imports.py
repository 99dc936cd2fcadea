"""The guard on private imports of torch/Ray: a missing private name gives a clear error.

The library's absence is simulated in ``sys.modules`` (what is under test is the guard)."""

from __future__ import annotations

import sys
import types

import pytest

from gangrun import checkpoint
from gangrun._compat_imports import TORCH_SUPPORTED, PrivateImportError, private_import

PRIVATE = "torch.distributed.checkpoint._fsspec_filesystem"


def test_guard_passes_through_when_present():
    mod = private_import("json.decoder", "JSONDecoder", supported="python")
    import json.decoder

    assert mod is json.decoder.JSONDecoder


def test_missing_private_module(monkeypatch):
    pytest.importorskip("torch")  # the real torch is in the test venv: only the module goes
    monkeypatch.setitem(sys.modules, PRIVATE, None)  # import of it now raises ImportError
    with pytest.raises(PrivateImportError) as info:
        private_import(PRIVATE, "FsspecWriter", supported=TORCH_SUPPORTED)
    msg = str(info.value)
    assert PRIVATE in msg and TORCH_SUPPORTED in msg and "installed torch 2." in msg
    assert isinstance(info.value, ImportError)


def test_missing_private_attribute(monkeypatch):
    monkeypatch.setitem(sys.modules, "fakelib", types.ModuleType("fakelib"))
    monkeypatch.setitem(sys.modules, "fakelib._inner", types.ModuleType("fakelib._inner"))
    with pytest.raises(PrivateImportError, match=r"fakelib\._inner\.Thing.*fakelib>=1,<=2"):
        private_import("fakelib._inner", "Thing", supported="fakelib>=1,<=2")


def test_library_not_installed():
    with pytest.raises(PrivateImportError, match=r'not installed.*pip install "gangrun\[nolib'):
        private_import("nolib_gangrun_test._x", supported="nolib_gangrun_test>=1")


def test_checkpoint_uses_the_guard(monkeypatch):
    pytest.importorskip("torch")
    monkeypatch.delitem(sys.modules, "gangrun.checkpoint.volume", raising=False)
    monkeypatch.delitem(vars(checkpoint), "VolumeWriter", raising=False)
    monkeypatch.delattr(checkpoint, "volume", raising=False)  # the submodule, once imported
    fake = types.ModuleType(PRIVATE)
    fake.FsspecReader = object  # type: ignore[attr-defined]  # FsspecWriter moved away
    monkeypatch.setitem(sys.modules, PRIVATE, fake)
    with pytest.raises(PrivateImportError, match=r"_fsspec_filesystem\.FsspecWriter.*torch>=2\.4"):
        checkpoint.VolumeWriter  # noqa: B018  # reached on first use
