"""Quiet output, with real ranks: what the output shows around a failure, in a
stack dump, after Ctrl-C, and when two calls stream to the same place at once."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest
import rankfns

import gangrun
from conftest import assert_no_survivors, pids_alive
from gangrun import DistributedError

pytestmark = pytest.mark.slow


def _pids(d: Path) -> list[int]:
    return [int(p.name.rsplit(".", 1)[1]) for p in d.iterdir()]


def test_a_peers_echo_of_a_rank_failure_is_one_line_marked_as_a_consequence(tmp_path, capfd):
    """Rank 1 raises while rank 0 waits in ``all_reduce``: rank 0's gloo traceback
    ("Connection closed by peer") used to stream in whole after rank 1's, burying it. Now rank
    1's traceback is shown whole and rank 0's is one line marked as a consequence; rank 0's
    log file keeps every line."""
    fn = gangrun.distributed(processes=2, timeout=90, grace_period=10)
    with pytest.raises(DistributedError) as info:
        fn(rankfns.fails_while_peer_all_reduces).distributed(str(tmp_path))
    err = info.value
    assert err.rank == 1 and err.exc_type == "ValueError", str(err)
    shown = "".join(capfd.readouterr())
    lines = shown.splitlines()
    assert "[rank 1] Traceback (most recent call last):" in lines, shown
    assert "[rank 1] ValueError: rank one is broken" in lines, shown
    echoed = [ln for ln in lines if ln.startswith("[rank 0]")]
    assert len(echoed) == 1, shown  # the whole traceback was shown: 9 lines
    assert "Connection closed by peer" in echoed[0] and "a consequence" in echoed[0], echoed
    assert "its log file" in echoed[0]
    log0 = err.logs(0)
    assert "Traceback (most recent call last)" in log0 and "Connection closed by peer" in log0
    assert not pids_alive(_pids(tmp_path))


def test_stacks_list_the_users_threads_first_and_one_gangrun_thread(tmp_path):
    """``handle.stacks()`` (and ``gangrun stacks``, the hang guard: the same dumps) used to
    list two gangrun ``watch_liveness`` threads per forked rank, before the user's threads."""
    flag = tmp_path / "stop"
    h = gangrun.distributed(processes=2, timeout=120)(rankfns.with_a_thread_of_its_own).submit(
        str(flag)
    )
    try:
        deadline = time.monotonic() + 60
        while h.progress().ranks.keys() != {0, 1}:
            assert time.monotonic() < deadline and not h.done()
            time.sleep(0.1)
        stacks = h.stacks()
    finally:
        flag.write_text("")
    assert h.result(60) == [0, 1]
    assert set(stacks) == {0, 1}
    for rank, text in stacks.items():
        blocks = re.split(r"\n\s*\n", text.strip())
        kinds = ["gangrun" if "watch_liveness" in b else "user" for b in blocks]
        assert kinds.count("gangrun") == 1, (rank, text)  # one liveness thread, not two
        assert kinds.index("gangrun") == len(kinds) - 1, (rank, text)  # after the user's
        assert any("user_helper" in b for b in blocks) and any(
            "with_a_thread_of_its_own" in b for b in blocks
        ), text


def test_ctrl_c_in_a_script_ends_with_one_line_saying_what_was_stopped(script, tmp_path):
    """Before: a bare ``KeyboardInterrupt`` traceback through ``threading``'s frames, and no
    word of the ranks. Now the traceback ends at the user's call, and its last line says what
    was stopped."""
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    proc = script(
        f"""
        import signal, sys
        signal.signal(signal.SIGINT, signal.default_int_handler)
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        import rankfns
        from gangrun import distributed
        distributed(processes=2, timeout=120)(rankfns.sleeper).distributed({str(pid_dir)!r})
        """
    )
    try:
        deadline = time.monotonic() + 60
        while len(list(pid_dir.iterdir())) < 2:
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the ranks did not start"
            time.sleep(0.05)
        pids = _pids(pid_dir)
        os.kill(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=10)
    assert proc.returncode in (-signal.SIGINT, 130), err
    last = err.strip().splitlines()[-1]
    assert last == "KeyboardInterrupt: stopped 2 ranks of sleeper; nothing left running", err
    assert "threading.py" not in err, err
    assert not pids_alive(pids)
    assert_no_survivors(proc.pid)


def test_two_calls_at_once_name_themselves_in_their_prefixes(tmp_path, capfd):
    """Two calls streaming to the same place at once: each line names its call (before,
    both were ``[rank 0]``); a call alone keeps ``[rank N]``."""
    flags = tmp_path / "flags"
    flags.mkdir()

    def train(*a):
        return rankfns.talk(*a)

    def evaluate(*a):
        return rankfns.talk(*a)

    opts = {"processes": 2, "timeout": 90}
    a = gangrun.distributed(**opts)(train).submit("T", str(flags), "E")
    b = gangrun.distributed(**opts)(evaluate).submit("E", str(flags), "T")
    assert a.result(60) == [0, 1] and b.result(60) == [0, 1]
    out = capfd.readouterr().out.splitlines()
    for name, tag in (("train", "T"), ("evaluate", "E")):
        for r in (0, 1):
            during = [ln for ln in out if f"{tag} during" in ln and f"rank {r}]" in ln]
            assert len(during) == 3, out
            assert all(ln.startswith(f"[{name} rank {r}] ") for ln in during), during
    assert gangrun.distributed(**opts)(train).submit("S", str(flags), "S").result(60) == [0, 1]
    solo = [ln for ln in capfd.readouterr().out.splitlines() if "S during" in ln]
    assert len(solo) == 6 and all(re.match(r"\[rank [01]\] S during", ln) for ln in solo), solo
