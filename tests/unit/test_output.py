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
