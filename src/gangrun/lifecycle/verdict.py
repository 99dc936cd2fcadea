"""The hang verdict, as pure functions of what the caller read: each rank's ring of
``torch.distributed`` calls (`gangrun.wire.collectives`), how long each has shown no
progress, which are stopped, and their stacks.

`judge` decides: some rank has waited ``T`` seconds in a collective (or the rendezvous) while
a rank that collective needs has not entered it and shows no progress (or is stopped), or has
entered a different or mismatched one. `places` says where each rank is, in words, and
`message` writes the error's text. The sampling and the stack dumps are `gangrun.lifecycle.hang`'s.
"""

from __future__ import annotations

import linecache
import os
import re
import sysconfig
from collections import Counter

from ..wire.collectives import OpRecord, RingView
from ..wire.flight import FlightDump
from ..wire.hangs import Hang, RankPlace

INIT = "init_process_group"
_FRAME = re.compile(r'^\s+File "(?P<file>.*)", line (?P<line>\d+) in (?P<func>\S+)')
_STDLIB = sysconfig.get_paths()["stdlib"] + os.sep
_OWN = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep

Frame = tuple[str, int, str]  # file, line, function


def short(site: str) -> str:
    """``/a/b/train.py:38`` -> ``train.py:38``."""
    return os.path.basename(site) if site else "?"


def op_words(rec: OpRecord) -> str:
    if rec.op == INIT:
        return f"{INIT} at {short(rec.site)}"
    if rec.peer >= 0:
        way = "to" if rec.op in ("send", "isend") else "from"
        return f"{rec.op} #{rec.seq} {way} rank {rec.peer} at {short(rec.site)}"
    group = "" if rec.group == "world" else f" (group {rec.group})"
    return f"{rec.op} #{rec.seq}{group} at {short(rec.site)}"


def _signature(rec: OpRecord) -> tuple[str, int, int, str]:
    """What peers in one collective must agree on: op, number, element count and dtype (a
    [2, 4] tensor against an [8] one moves the same bytes: no hang)."""
    return rec.op, rec.seq, rec.numel, rec.shapes.partition("[")[0]


def _members(rec: OpRecord, world: int) -> list[int]:
    if rec.peer >= 0:
        return [rec.peer]
    if rec.group != "world" and re.fullmatch(r"\d+(,\d+)*", rec.group):
        return [int(x) for x in rec.group.split(",") if int(x) < world]
    return list(range(world))


def judge(
    rings: dict[int, RingView | None],
    quiet: dict[int, float],
    stopped: set[int],
    world: int,
    timeout: float,
    now: float,
) -> Hang | None:
    """The hang, if there is one now (see the module); ``quiet``: seconds each rank has shown
    no progress; ``now``: wall clock."""
    current = {r: (v.current if v is not None else None) for r, v in rings.items()}
    waiting = sorted(
        (rec.entered, r, rec)
        for r, rec in current.items()
        if rec is not None and now - rec.entered >= timeout
    )
    for _, r, rec in waiting:
        if rec.region and quiet.get(r, 0.0) < timeout:
            continue  # in backward() and busy: computing, not waiting
        found = _mismatch(r, rec, current, world, timeout, now) or _missing(
            r, rec, rings, current, quiet, stopped, world, timeout, now
        )
        if found is not None:
            return found
    return None


def _mismatch(
    r: int, rec: OpRecord, current: dict[int, OpRecord | None], world: int, timeout: float,
    now: float,
) -> Hang | None:  # fmt: skip
    if rec.region or rec.peer >= 0 or rec.op == INIT:
        return None
    inside = {
        q: c
        for q in _members(rec, world)
        if (c := current.get(q)) is not None and c.group == rec.group and c.peer < 0
        and not c.region and c.op != INIT
    }  # fmt: skip
    sigs = Counter(_signature(c) for c in inside.values())
    if len(sigs) < 2:
        return None
    ref = max(
        sigs, key=lambda s: (sigs[s], -min(q for q, c in inside.items() if _signature(c) == s))
    )
    waiters = tuple(sorted(q for q, c in inside.items() if _signature(c) == ref))
    holders = tuple(sorted(q for q in inside if q not in waiters))
    op = inside[waiters[0]]
    waited = now - min(inside[q].entered for q in waiters)
    if waited < timeout:
        return None
    return Hang("mismatch", holders, waiters, op, waited, timeout, ())


def _missing(
    r: int, rec: OpRecord, rings: dict[int, RingView | None], current: dict[int, OpRecord | None],
    quiet: dict[int, float], stopped: set[int], world: int, timeout: float, now: float,
) -> Hang | None:  # fmt: skip
    holders, mismatched = [], []
    for q in _members(rec, world):
        if q == r:
            continue
        cur = current.get(q)
        same_op = cur is not None and (cur.op, cur.group) == (rec.op, rec.group)
        if same_op and not rec.region and (rec.peer >= 0 or cur is not None and cur.seq == rec.seq):
            continue  # in it too
        ring = rings.get(q)
        collective = rec.peer < 0 and not rec.region and rec.op != INIT
        same = None if ring is None or not collective else ring.find(rec.group, rec.seq)
        if same is not None and not same.inside and _signature(same) != _signature(rec):
            mismatched.append(q)  # went through it with other shapes (gloo lets an empty one)
            continue
        last = None if ring is None else ring.last_on(rec.group)
        passed = last is not None and (rec.op == INIT or last.seq >= rec.seq)
        if passed and last is not None and not last.inside and rec.peer < 0 and not rec.region:
            continue  # went past it
        if cur is not None and not cur.region and q not in stopped:
            continue  # waiting in another collective itself
        if q in stopped or quiet.get(q, 0.0) >= timeout:
            holders.append(q)
        else:
            return None  # a needed rank still makes progress: not (yet) a hang
    if mismatched:
        return Hang("mismatch", tuple(mismatched), (r,), rec, now - rec.entered, timeout, ())
    if not holders:
        return None
    kind = "stopped" if any(q in stopped for q in holders) else "not entered"
    if kind == "not entered" and rec.op == INIT:
        kind = "never initialized"
    waiters = tuple(
        sorted(q for q, c in current.items() if c is not None and _signature(c) == _signature(rec)
               and c.group == rec.group)
    )  # fmt: skip
    return Hang(kind, tuple(holders), waiters or (r,), rec, now - rec.entered, timeout, ())


# ----------------------------------------------------------------------- stacks, in words
def frames(stack: str) -> list[Frame]:
    """The signalled (main) thread's frames of a faulthandler dump, innermost first."""
    blocks = re.split(r"\n(?=(?:Current thread|Thread) 0x)", stack.strip())
    chosen = next(
        (b for b in blocks if b.startswith("Current thread")), blocks[0] if blocks else ""
    )
    out = []
    for line in chosen.splitlines():
        m = _FRAME.match(line)
        if m:
            out.append((m["file"], int(m["line"]), m["func"]))
    return out


def internal(file: str) -> bool:
    return (
        file.startswith((_STDLIB, _OWN, "<frozen"))
        or f"{os.sep}site-packages{os.sep}" in file
        or f"{os.sep}dist-packages{os.sep}" in file
    )


def user_frame(fr: list[Frame]) -> Frame | None:
    return next((f for f in fr if not internal(f[0])), None)


def _code(file: str, line: int) -> str:
    text = linecache.getline(file, line).split("  #")[0].strip()
    return f" (`{text}`)" if text and len(text) < 80 else ""


def _outside_words(stack: str, workers: list[str]) -> tuple[str, str]:
    """(site, words) for a rank outside any collective, from its stack and its children's."""
    fr = frames(stack)
    uf = user_frame(fr)
    site = "" if uf is None else f"{uf[0]}:{uf[1]}"
    if any(f[2] == "__next__" and "torch/utils/data" in f[0] for f in fr):
        blocked = []
        for i, w in enumerate(workers):
            wf = user_frame(frames(w))
            if wf is not None:
                fn = "dataset.__getitem__" if wf[2] == "__getitem__" else wf[2]
                blocked.append(f"worker {i} blocked in {fn} at {short(f'{wf[0]}:{wf[1]}')}")
        inner = f" ({'; '.join(blocked)})" if blocked else ""
        return site, f"in DataLoader.__next__{inner} at {short(site)}"
    if uf is None:
        return site, "outside any collective (no stack)" if not fr else "in library code"
    return site, f"at {short(site)} in {uf[2]}{_code(uf[0], uf[1])}, outside any collective"


def _mismatch_words(
    cur: OpRecord | None, ring: RingView | None, ref: OpRecord, w: int, stack: str,
    workers: list[str],
) -> str:  # fmt: skip
    left = cur is None or cur.group != ref.group
    mine = cur if not left else None if ring is None else ring.find(ref.group, ref.seq)
    if mine is None:
        return _outside_words(stack, workers)[1]
    verb = "left" if left else "in"
    then = f", then {_outside_words(stack, workers)[1]}" if left else ""
    if (mine.op, mine.seq) == (ref.op, ref.seq) and mine.numel != ref.numel:
        return (f"{verb} {mine.op} #{mine.seq} with {mine.numel} elements where rank {w} has "
                f"{ref.numel} (at {short(mine.site)}){then}")  # fmt: skip
    if (mine.op, mine.seq) == (ref.op, ref.seq):
        return (f"{verb} {mine.op} #{mine.seq} with {mine.shapes} where rank {w} has "
                f"{ref.shapes} (at {short(mine.site)}){then}")  # fmt: skip
    return f"{verb} {op_words(mine)} while rank {w} is in {op_words(ref)}{then}"


def places(
    hang: Hang | None,
    rings: dict[int, RingView | None],
    quiet: dict[int, float],
    stopped: set[int],
    stacks: dict[int, str],
    workers: dict[int, list[str]],
    world: int,
    now: float,
    flights: dict[int, FlightDump] | None = None,
) -> tuple[RankPlace, ...]:
    """Where each rank is, in words (the holders' words say how they hold the others)."""
    out = []
    ref = None if hang is None else hang.op
    for r in range(world):
        ring = rings.get(r)
        cur = None if ring is None else ring.current
        q = quiet.get(r, 0.0)
        stack = stacks.get(r, "")
        uf = user_frame(frames(stack)) if stack else None
        site = cur.site if cur is not None else "" if uf is None else f"{uf[0]}:{uf[1]}"
        if r in stopped:
            last = "" if cur is None else f", inside {op_words(cur)}"
            words = f"stopped (SIGSTOP){last}"
        elif hang is not None and hang.kind == "mismatch" and r in hang.holders and ref:
            words = _mismatch_words(cur, ring, ref, hang.waiters[0], stack, workers.get(r, []))
        elif cur is not None:
            waited = now - cur.entered
            words = f"in {op_words(cur)}, for {waited:.1f}s"
            if cur.region:
                words = (f"in {cur.op} at {short(cur.site)} (where DDP/FSDP communicate from "
                         f"C++), for {waited:.1f}s")  # fmt: skip
        else:
            site, words = _outside_words(stack, workers.get(r, []))
            inited = ring is not None and any(x.op == INIT for x in ring.records)
            if not inited and hang is not None and hang.op.op == INIT:
                words = f"never reached {INIT}; {words}"
            words += f"; no progress for {q:.1f}s" if q >= 1 else "; making progress"
        fl = (flights or {}).get(r)
        if fl is not None and fl.entries:
            words += f"; Flight Recorder: {flight_words(fl)}"
        out.append(RankPlace(r, site, words, cur, q, r in stopped))
    return tuple(out)


def flight_words(dump: FlightDump) -> str:
    """The device-side state of a rank's last collectives, in words."""
    last = dump.entries[-1]
    text = f"last {last.op} #{last.seq} {last.state}"
    pending = [e for e in dump.entries if e.state != "completed"]
    if pending and pending[0] is not last:
        first = pending[0]
        text += f", oldest not completed {first.op} #{first.seq} {first.state}"
    return text


def _inside(view: RingView, start: float, now: float) -> tuple[float, Counter[tuple[str, str]]]:
    """Seconds of [start, now] the rank spent inside collectives, and per (op, site)."""
    total, per = 0.0, Counter[tuple[str, str]]()  # seconds
    for rec in view.records:
        if rec.region or rec.op == INIT:
            continue
        t = min(rec.left or now, now) - max(rec.entered, start)
        if t > 0:
            total += t
            per[(rec.op, rec.site)] += t  # type: ignore[assignment]  # a Counter of seconds
    return total, per


def slow_cause(rings: dict[int, RingView | None], rank: int, now: float, window: float) -> str:
    """Why ``rank`` is slow, from the records: the share of their time its peers spend
    waiting in collectives, against its own ('' when the records do not say)."""
    views = {r: v for r, v in rings.items() if v is not None and v.records}
    if rank not in views or len(views) < 2:
        return ""
    start = max([now - window] + [min(x.entered for x in v.records) for v in views.values()])
    span = now - start
    if span <= 0:
        return ""
    own, _ = _inside(views[rank], start, now)
    waits, where = [], Counter[tuple[str, str]]()
    for r, v in views.items():
        if r != rank:
            t, per = _inside(v, start, now)
            waits.append(t)
            where.update(per)
    peers = sorted(waits)[len(waits) // 2] / span
    if not where or peers <= own / span:
        return ""
    (op, site), _ = where.most_common(1)[0]
    return f"its peers wait for it {peers:.0%} of their step in {op} at {short(site)}"


def where_section(places_: tuple[RankPlace, ...], first: tuple[int, ...] = ()) -> str:
    order = [p for p in places_ if p.rank in first] + [p for p in places_ if p.rank not in first]
    return "\n".join(f"  rank {p.rank}: {p.words}" for p in order)


def message(
    fn_name: str, hang: Hang, world: int, stacks: dict[int, str], log_dir: str, ending: str = ""
) -> str:
    holders = ", ".join(map(str, hang.holders))
    waiters = ", ".join(map(str, hang.waiters))
    plural = "s" if len(hang.holders) > 1 else ""
    what = {
        "mismatch": "entered a different or mismatched collective",
        "stopped": "is stopped",
        "never initialized": f"never reached {INIT}",
        "not entered": "has not entered it and makes no progress",
    }[hang.kind]
    head = (
        f"{fn_name} hung: rank{plural} {holders} held up rank(s) {waiters}, waiting "
        f"{hang.waited:.1f}s in {op_words(hang.op)} (hang_timeout={hang.timeout:g}s): rank{plural} "
        f"{holders} {what}. {ending or f'All {world} ranks were stopped.'}"
    )
    where = where_section(hang.places, hang.holders)
    order = list(hang.holders) + sorted(r for r in stacks if r not in hang.holders)
    parts = []
    for r in order:
        place = hang.place(r)
        if place is not None and place.stopped:
            text = "(stopped by SIGSTOP: no stack dump)"
        else:
            text = stacks.get(r) or "(no stack dump: the rank did not answer SIGUSR1)"
        tag = "holding" if r in hang.holders else "waiting" if r in hang.waiters else ""
        parts.append(f"--- rank {r}{f' ({tag})' if tag else ''} ---\n{text.rstrip()}")
    return (
        f"{head}\nWhere each rank was:\n{where}\n\nPython stacks (the holding ranks first):\n\n"
        + "\n\n".join(parts)
        + f"\n\nFull logs: err.logs(rank), or the files in {log_dir}. Fix the rank that holds "
        "the others, or raise hang_timeout= (None: off) if it is legitimately busy."
    )


__all__ = [
    "slow_cause",
    "frames",
    "judge",
    "message",
    "op_words",
    "places",
    "short",
    "user_frame",
    "where_section",
]
