"""The fork-server registry keeps one server per start-up signature while calls use it,
with a fake server factory: no processes."""

from __future__ import annotations

import os

from fakes import FakeServer
from gangrun.launch.forkserver.client import Registry, startup_signature


def test_a_call_with_another_signature_keeps_the_running_server():
    """B (PYTHONHASHSEED=0) must not close A's server while A runs."""
    reg = Registry(FakeServer)  # type: ignore[arg-type]
    a = reg.lease(startup_signature({}))
    b = reg.lease(startup_signature({"PYTHONHASHSEED": "0"}))
    assert a is not b and not a.closed and not b.closed
    assert reg.lease(startup_signature({})) is a  # shared by calls of the same signature
    reg.release(a)
    reg.release(a)
    reg.release(b)
    c = reg.lease(startup_signature({"LD_BIND_NOW": "1"}))  # the idle others are closed now
    assert a.closed and b.closed and not c.closed
    assert reg.servers() == [c]


def test_idle_server_kept_warm_and_dead_one_replaced():
    reg = Registry(FakeServer)  # type: ignore[arg-type]
    sig = startup_signature({"OMP_NUM_THREADS": "3", "PATH": "x"})
    assert sig == ()  # runtime variables do not split servers
    a = reg.lease(sig)
    reg.release(a)
    assert reg.lease(sig) is a and not a.closed  # the warm relaunch
    a.dead = True
    b = reg.lease(sig)
    assert b is not a and reg.current() is b


def test_failed_start_is_remembered():
    def broken(*_):
        raise OSError("no")

    reg = Registry(broken)  # type: ignore[arg-type]
    try:
        reg.lease(())
    except OSError:
        pass
    assert reg.start_failure == "OSError: no"


def test_forked_child_forgets_the_servers():
    """A child forked from the caller closes its copies of the server channels."""
    reg = Registry(FakeServer)  # type: ignore[arg-type]
    a = reg.lease(())
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.write(w, b"1" if (a.closed and reg.servers() == []) else b"0")
        os._exit(0)
    os.waitpid(pid, 0)
    assert os.read(r, 1) == b"1"
    assert not a.closed and reg.servers() == [a]
    os.close(r)
    os.close(w)
