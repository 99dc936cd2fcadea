"""The output pump: prefixes, progress bars, partial lines, log files (pipes, no processes)."""

from __future__ import annotations

import io
import os

from gangrun.output import OutputPump


def pump_text(chunks_by_rank: dict[int, list[bytes]], mode: str = "all", tmp_path=None):
    out, err = io.StringIO(), io.StringIO()
    pump = OutputPump(out, err, mode)
    logs = {}
    writers = {}
    for rank in chunks_by_rank:
        r, w = os.pipe()
        logs[rank] = io.BytesIO()
        logs[rank].close = lambda: None  # type: ignore[method-assign]
        pump.add(rank, "out", r, logs[rank])
        writers[rank] = w
    pump.start()
    for rank, chunks in chunks_by_rank.items():
        for c in chunks:
            os.write(writers[rank], c)
        os.close(writers[rank])
    pump.close(drain_timeout=5)
    return out.getvalue(), {r: b.getvalue() for r, b in logs.items()}


def test_prefixes_and_logs():
    text, logs = pump_text({0: [b"a\nb\n"], 1: [b"c\n"]})
    lines = text.splitlines()
    assert sorted(lines) == ["[rank 0] a", "[rank 0] b", "[rank 1] c"]
    assert logs[0] == b"a\nb\n" and logs[1] == b"c\n"


def test_partial_line_at_eof_and_split_utf8():
    snow = "☃".encode()
    text, _ = pump_text({0: [b"x" + snow[:1], snow[1:] + b"y"]})
    assert text == "[rank 0] x☃y\n"


def test_carriage_return_progress_is_one_line():
    frames = b"".join(b"\r%3d%%|" % i for i in range(0, 101, 10)) + b"\n"
    text, logs = pump_text({0: [frames]})
    # the saved text, once \r is applied as a terminal/Jupyter does, is one line
    rendered = [seg.split("\r")[-1] for seg in text.split("\n") if seg]
    assert rendered == ["[rank 0] 100%|"]
    assert text.count("\n") == 1
    assert logs[0] == frames


def test_rank0_mode_and_none_mode():
    text, logs = pump_text({0: [b"zero\n"], 1: [b"one\n"]}, mode="rank0")
    assert text == "[rank 0] zero\n"
    assert logs[1] == b"one\n"
    text, logs = pump_text({0: [b"zero\n"]}, mode="none")
    assert text == "" and logs[0] == b"zero\n"


def test_many_lines_none_lost():
    body = b"".join(b"line %d\n" % i for i in range(20000))
    text, _ = pump_text({0: [body[i : i + 7777] for i in range(0, len(body), 7777)]})
    lines = text.splitlines()
    assert len(lines) == 20000
    assert lines[-1] == "[rank 0] line 19999"


class CountingStream:
    """A caller stream that keeps only how much was written (and the last few characters)."""

    def __init__(self) -> None:
        self.chars = 0
        self.writes = 0
        self.tail = ""

    def write(self, text: str) -> int:
        self.chars += len(text)
        self.writes += 1
        self.tail = (self.tail + text)[-64:]
        return len(text)

    def flush(self) -> None:
        pass


def test_long_line_without_newline_is_not_redrawn_over_and_over(tmp_path):
    """A rank writing a 20 MiB line without a newline, in pieces with pauses (so the open
    line is older than the idle flush): a pump rewriting the whole line on every read would
    send 1.5 GB to the caller. What reaches the caller must stay within a small factor of the
    input; the log file keeps exactly the input."""
    import threading
    import time

    total = 20 << 20
    piece = b"x" * (256 << 10)
    target = CountingStream()
    pump = OutputPump(target, io.StringIO(), "all")
    r, w = os.pipe()
    log_path = tmp_path / "rank-0.log"
    log = open(log_path, "wb")  # noqa: SIM115 - the pump owns it until close
    pump.add(0, "out", r, log)
    pump.start()

    def writer() -> None:
        sent = 0
        while sent < total:
            os.write(w, piece)
            sent += len(piece)
            time.sleep(0.3 if sent == len(piece) else 0.002)  # first pause: the line is shown
        os.close(w)

    t0 = time.monotonic()
    thread = threading.Thread(target=writer)
    thread.start()
    thread.join(60)
    pump.close(drain_timeout=10)
    elapsed = time.monotonic() - t0
    log.close()
    assert os.path.getsize(log_path) == total
    assert log_path.read_bytes() == b"x" * total
    assert target.chars <= 3 * total, f"{target.chars} chars written for a {total}-byte line"
    assert target.chars >= total
    assert target.tail.endswith("x\n")
    assert elapsed < 30


def test_interrupted_short_line_is_redrawn_whole_long_one_continues():
    """A partial line cut by another rank's line is shown whole again when it ends (short
    lines), or continued with a ``[rank N]+`` prefix (lines too long to redraw)."""
    import time

    out = io.StringIO()
    pump = OutputPump(out, io.StringIO(), "all")
    pipes = {}
    for rank in (0, 1):
        r, w = os.pipe()
        log = io.BytesIO()
        log.close = lambda: None  # type: ignore[method-assign]
        pump.add(rank, "out", r, log)
        pipes[rank] = w
    pump.start()
    os.write(pipes[0], b"epoch 1: ")
    time.sleep(0.5)  # shown after the idle time
    os.write(pipes[1], b"other\n")
    time.sleep(0.3)
    os.write(pipes[0], b"loss 0.5\n")
    time.sleep(0.3)
    long = b"y" * 100_000
    os.write(pipes[0], long)
    time.sleep(0.5)
    os.write(pipes[1], b"again\n")
    time.sleep(0.3)
    os.write(pipes[0], b"z\n")
    for w in pipes.values():
        os.close(w)
    pump.close(drain_timeout=5)
    text = out.getvalue()
    lines = text.split("\n")
    assert "[rank 0] epoch 1: loss 0.5" in lines
    assert "[rank 1] other" in lines and "[rank 1] again" in lines
    assert "[rank 0]+ z" in lines
    assert text.count("y") == len(long)


def test_two_ranks_bars_stay_one_line_each():
    """Two ranks' progress bars on one stream: each bar ends up as one line, not one per
    frame, and the bytes written stay below what the ranks wrote."""
    frames = {r: [b"\r%3d%%|bar%d" % (i, r) for i in range(0, 101)] + [b"\n"] for r in (0, 1)}
    text, logs = pump_text(frames)
    rendered = [seg.split("\r")[-1] for seg in text.split("\n") if seg]
    assert sorted(rendered) == ["[rank 0] 100%|bar0", "[rank 1] 100%|bar1"]
    assert len(text) <= sum(len(b"".join(f)) for f in frames.values())
    assert logs[0] == b"".join(frames[0])
