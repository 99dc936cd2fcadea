"""The rank actor reports a rank's exit before reaping it (no Ray needed: the actor's methods
run on a plain instance). Reaping drops the zombie's /proc entries, which on Linux 6.x can
spin for seconds in the kernel while the rank's other threads flush theirs; the exit must not
wait for it."""

from __future__ import annotations

import subprocess
import sys
import threading

from gangrun.launch.ray.actor import RankActor, _exit_status


def test_exit_status_is_known_before_the_reap_and_reaps_nothing():
    for code, want in (
        ("raise SystemExit(3)", 3),
        ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", -9),
    ):
        p = subprocess.Popen([sys.executable, "-c", code])
        assert _exit_status(p.pid) == want
        with open(f"/proc/{p.pid}/stat") as f:  # still there: a zombie, not reaped
            assert f.read().rsplit(")", 1)[1].split()[0] == "Z"
        assert p.wait(5) == want  # Popen reaps it as usual


def test_actor_reports_the_exit_while_the_reap_is_still_running(monkeypatch):
    actor = RankActor("rid", 0)
    actor.proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(7)"])
    real_wait = actor.proc.wait
    reaping, release = threading.Event(), threading.Event()

    def slow_reap(timeout=None):  # the kernel's slow release_task, held open by the test
        reaping.set()
        release.wait(30)
        return real_wait(timeout)

    monkeypatch.setattr(actor.proc, "wait", slow_reap)
    t = threading.Thread(target=actor._wait, daemon=True)
    t.start()
    try:
        assert reaping.wait(30), "the rank was never reaped"
        assert actor._code == 7  # already reported, the reap not done
        actor._open = 0  # no output pipes in this test
        polled = actor.poll(0.5)
        assert polled.exit == 7
    finally:
        release.set()
        t.join(30)
    assert actor.proc.returncode == 7 and not t.is_alive()


def test_a_child_reaped_elsewhere_falls_back_to_popen():
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait(5)
    assert _exit_status(p.pid) is None


WATCHED = """
import sys, time
from gangrun.launch.ray.actor import RankActor
actor = RankActor("rid", 0, caller_deadline=1.0)
for _ in range(int(sys.argv[1])):  # the caller beats every 0.2 s...
    actor.beat()
    time.sleep(0.2)
print("stopped", flush=True)  # ...then dies
time.sleep(30)
"""


def test_an_actor_whose_caller_stops_beating_ends_within_its_deadline():
    """The actor's own watch ends it (and its rank) once the caller's
    heartbeat stops, however the caller was connected; while it beats, nothing happens."""
    import time

    p = subprocess.Popen([sys.executable, "-c", WATCHED, "8"], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None
        assert p.stdout.readline().strip() == "stopped"  # alive through 1.6 s of beats
        t0 = time.monotonic()
        assert p.wait(15) == 1
        assert time.monotonic() - t0 < 3.0
    finally:
        p.kill()
        p.wait(5)
