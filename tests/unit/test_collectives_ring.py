"""``collectives.<rank>``: the ring a rank writes and the caller reads while the rank is stuck
(written and read back, wrapped around, torn slots dropped), and the verdict's words for a
case gloo cannot produce (it aborts on most size mismatches; NCCL hangs)."""

from __future__ import annotations

import struct

from gangrun.lifecycle import verdict
from gangrun.wire import collectives as ring_file
from gangrun.wire.collectives import HEADER, SLOT, SLOTS, OpRecord, Ring


def rec(op: str = "all_reduce", seq: int = 1, numel: int = 4, entered: float = 100.0) -> OpRecord:
    return OpRecord(op, "world", seq, -1, numel, f"float32[{numel}]", "/a/train.py:38", entered, 0)


def test_written_and_read_back_while_inside_then_left(tmp_path):
    ring = Ring.open(ring_file.path(str(tmp_path), 3), 3)
    off = ring.enter(rec())
    view = ring_file.read(str(tmp_path), 3)
    assert view is not None and view.rank == 3 and view.written == 1
    assert view.records == (rec(),) and view.current == rec() and view.records[0].inside
    ring.leave(off, 101.5)
    view = ring_file.read(str(tmp_path), 3)
    assert view is not None and view.current is None and view.records[0].left == 101.5
    assert view.last_on("world") == view.find("world", 1) == view.records[0]


def test_wraps_around_keeping_the_newest(tmp_path):
    ring = Ring.open(ring_file.path(str(tmp_path), 0), 0)
    for i in range(1, SLOTS + 6):
        ring.leave(ring.enter(rec(seq=i)), 1.0)
    view = ring_file.read(str(tmp_path), 0)
    assert view is not None and view.written == SLOTS + 5
    assert [r.seq for r in view.records] == list(range(6, SLOTS + 6))


def test_long_text_is_cut_keeping_the_line_number(tmp_path):
    ring = Ring.open(ring_file.path(str(tmp_path), 0), 0)
    long_site = "/very" * 60 + "/train.py:1234"
    ring.enter(OpRecord("all_reduce", "world", 1, -1, 1, "x" * 99, long_site, 1.0, 0.0))
    view = ring_file.read(str(tmp_path), 0)
    assert view is not None
    assert view.records[0].site.endswith("/train.py:1234") and len(view.records[0].shapes) == 40


def test_torn_or_overwritten_slots_are_dropped(tmp_path):
    ring = Ring.open(ring_file.path(str(tmp_path), 0), 0)
    for i in range(1, 4):
        ring.enter(rec(seq=i))
    with open(ring_file.path(str(tmp_path), 0), "rb") as f:
        raw = bytearray(f.read())
    struct.pack_into("<Q", raw, HEADER + 1 * SLOT, 2 * 2 - 1)  # slot 2 being written (odd)
    struct.pack_into("<Q", raw, HEADER + 2 * SLOT, 2 * 4)  # a counter not of its slot
    view = ring_file.parse(bytes(raw))
    assert view is not None and [r.seq for r in view.records] == [1]
    assert ring_file.parse(bytes(raw[:100])) is None  # a short file is no ring
    assert ring_file.parse(b"X" * len(raw)) is None  # nor is another file
    assert ring_file.read(str(tmp_path), 7) is None  # no file: no ring


def view(rank: int, *records: OpRecord) -> ring_file.RingView:
    return ring_file.RingView(rank, 1, len(records), records)


def test_mismatched_shapes_are_said_with_their_element_counts():
    init = OpRecord("init_process_group", "world", 0, -1, -1, "", "/a/t.py:5", 1.0, 2.0)
    rings = {0: view(0, init, rec(numel=4)), 1: view(1, init, rec(numel=8, entered=101.0))}
    hang = verdict.judge(rings, {0: 9.0, 1: 9.0}, set(), 2, 5.0, now=110.0)
    assert hang is not None and hang.kind == "mismatch" and hang.holders == (1,)
    places = verdict.places(hang, rings, {0: 9.0, 1: 9.0}, set(), {}, {}, 2, 110.0)
    assert "in all_reduce #1 with 8 elements where rank 0 has 4" in places[1].words


def test_a_progressing_peer_or_a_short_wait_is_no_hang():
    init = OpRecord("init_process_group", "world", 0, -1, -1, "", "/a/t.py:5", 1.0, 2.0)
    rings = {0: view(0, init, rec()), 1: view(1, init)}
    assert verdict.judge(rings, {0: 9.0, 1: 0.2}, set(), 2, 5.0, now=110.0) is None  # busy
    assert verdict.judge(rings, {0: 9.0, 1: 9.0}, set(), 2, 5.0, now=102.0) is None  # 2 s only
    hang = verdict.judge(rings, {0: 9.0, 1: 9.0}, set(), 2, 5.0, now=110.0)
    assert hang is not None and hang.kind == "not entered" and hang.holders == (1,)
    stopped = verdict.judge(rings, {0: 9.0, 1: 0.0}, {1}, 2, 5.0, now=110.0)
    assert stopped is not None and stopped.kind == "stopped"


# torch's Flight Recorder: its dump's dict (what `_dump_nccl_trace` returns on a GPU node, which
# we lack) stands in for the GPU; the thread, the request file and the caller's reading are real
NCCL_DUMP = {
    "version": "2.8",
    "entries": [
        {"profiling_name": "nccl:all_reduce", "collective_seq_id": 11, "state": "completed",
         "process_group": ("0", "default_pg"), "input_sizes": [[4]], "input_dtypes": ["Float"],
         "time_created_ns": 1_000_000_000},
        {"profiling_name": "nccl:all_reduce", "collective_seq_id": 12, "state": "started",
         "process_group": ("0", "default_pg"), "input_sizes": [[4]], "input_dtypes": ["Float"],
         "time_created_ns": 2_000_000_000},
    ],
}  # fmt: skip


def test_flight_recorder_is_dumped_on_request_and_said(tmp_path, monkeypatch):
    from gangrun.lifecycle.hang import HangGuard
    from gangrun.rank import flight
    from gangrun.wire import flight as flight_file

    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "64")
    monkeypatch.setattr(flight, "_dump", lambda: NCCL_DUMP)
    monkeypatch.setattr(flight, "_started", False)
    flight.start(str(tmp_path), 1)
    assert flight_file.read(str(tmp_path), 1) == flight_file.FlightDump(1, 0.0, ())
    got = HangGuard(str(tmp_path), str(tmp_path), 2, 3.0)._flights([0, 1])
    dump = got[1]
    assert [(e.op, e.seq, e.state) for e in dump.entries] == [
        ("all_reduce", 11, "completed"),
        ("all_reduce", 12, "started"),
    ]
    assert verdict.flight_words(dump) == "last all_reduce #12 started"
    init = OpRecord("init_process_group", "world", 0, -1, -1, "", "/a/t.py:5", 1.0, 2.0)
    places = verdict.places(None, {1: view(1, init, rec())}, {}, set(), {}, {}, 2, 110.0, got)
    assert "Flight Recorder: last all_reduce #12 started" in places[1].words


def test_auto_timeout_is_three_p99_step_times_at_least_ten_seconds(tmp_path):
    from gangrun.lifecycle.hang import AUTO_MIN_S, HangGuard
    from gangrun.wire import progress

    guard = HangGuard(str(tmp_path), str(tmp_path), 1, "auto")
    assert guard.on and guard.timeout == AUTO_MIN_S == 10.0
    fd = progress.open_for_writing(str(tmp_path), 0)
    for step, t in ((1, 100.0), (2, 102.0), (4, 110.0)):  # 2 s, then 4 s per step
        progress.write(fd, progress.StepReport(0, step, None, None, 1, 100.0, t))
        guard.sample({}, [0])
    assert guard.timeout == 12.0  # 3 x the slowest (p99) of the step times seen
    assert HangGuard(str(tmp_path), str(tmp_path), 1, 4.0).timeout == 4.0  # explicit T
    assert not HangGuard(str(tmp_path), str(tmp_path), 1, None).on  # off
