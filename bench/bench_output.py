"""(5) Output: 2 ranks printing 200k numbered lines each.

Every line must reach the caller's ``sys.stdout`` (counted and checked here, in the caller);
the slowdown is the call's time with ``output="all"`` over ``output="none"``.
"""

from __future__ import annotations

import contextlib
import re
import time

import workloads
from _common import main, ratio, summary, timed

LINES = 200_000
_LINE = re.compile(r"^\[rank (\d+)\] r(\d+) line (\d+)$")


class Counter:
    """A caller-side stdout that keeps what it gets; checked after the timed call, so that
    the check costs no CPU while the ranks run."""

    def __init__(self) -> None:
        self.chunks: list[str] = []
        self.seen: list[set[int]] = [set(), set()]
        self.bad = 0

    def write(self, text: str) -> int:
        self.chunks.append(text)
        return len(text)

    def flush(self) -> None:
        pass

    def check(self) -> None:
        for ln in "".join(self.chunks).split("\n"):
            m = _LINE.match(ln.lstrip("\r"))
            if m is None or m.group(1) != m.group(2):
                if ln.strip():
                    self.bad += 1
                continue
            self.seen[int(m.group(1))].add(int(m.group(3)))


def run(reps: int) -> dict:
    from gangrun import distributed

    base = dict(processes=2, mlflow=False, timeout=600)
    g_all = distributed(**base, output="all")(workloads.printer)
    g_none = distributed(**base, output="none")(workloads.printer)
    g_none.distributed(10)
    t_all: list[float] = []
    t_none: list[float] = []
    lost: list[int] = []
    bad = 0
    for _ in range(reps):
        c = Counter()
        with contextlib.redirect_stdout(c):  # type: ignore[type-var]
            dt, _ = timed(lambda: g_all.distributed(LINES, 100))
        t_all.append(dt)
        c.check()
        lost.append(sum(LINES - len(s) for s in c.seen))
        bad += c.bad
        dt, _ = timed(lambda: g_none.distributed(LINES, 100))
        t_none.append(dt)
        time.sleep(0.2)
    return {
        "name": "output",
        "unit": "s",
        "lines_per_rank": LINES,
        "lost_lines": lost,
        "garbled_lines": bad,
        "results": {"output_all": summary(t_all), "output_none": summary(t_none)},
        "ratios": {
            "all_vs_none": ratio(summary(t_all)["median"], summary(t_none)["median"]),
        },
    }


if __name__ == "__main__":
    main(run)
