"""The machinery of tests/soak/test_resume_exactness.py: a `Config` (one training of
`resume_fns.train`, one way of saving, a list of interruptions `Event`) and its `draw`;
`check` runs it call after call (`Run`) and `compare`s every traced step, the final
parameters and plain values and the MLflow history with the uninterrupted run (`baseline`,
cached per training). With 3 ranks losses and parameters are compared to `TOL3` (DDP's
bucket caveat, docs/long_runs.md; measured 3e-8 on weights of about 0.1)."""

from __future__ import annotations

import ast
import json
import os
import random
import re
import signal
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import resume_fns
import torch

import gangrun
from conftest import assert_no_survivors

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "system"))
from test_long_runs import _history, _wait_for  # noqa: E402  (tests/system)

TOTAL = 14  # steps; 6 batches per rank and epoch: epochs begin at steps 6 and 12
EPOCH_STEPS = resume_fns.SAMPLES_PER_RANK // resume_fns.BATCH
KINDS = ("rank_kill", "caller_kill", "sigterm", "cancel")
LOADERS = ("volume", "table", "plain")
TOL3 = (1e-5, 1e-7)  # (rtol, atol) for losses and parameters of DDP over 3 ranks
CALL_TIMEOUT = 180.0
# DDP's constructor imports torch._dynamo (about 3 s per rank on a loaded 2-core machine)
# and the manager's metric logging imports mlflow: preloaded in the fork server, a call of
# the training takes about 1 s instead of 4 (MLflow off), 3-5 s instead of 8-10 (on).
PRELOAD = ["torch", "torch._dynamo", "torch.distributed.checkpoint"]


@dataclass(frozen=True)
class Event:
    """One interruption: ``kind`` at step ``step`` (after that step's update, before the
    manager's bookkeeping of it); ``rank``: the rank killed (``rank_kill``); ``settle``: the
    save in flight is committed first."""

    kind: str
    step: int
    rank: int = 0
    settle: bool = True

    def describe(self) -> str:
        who = f" rank {self.rank}" if self.kind == "rank_kill" else ""
        return f"{self.kind}@{self.step}{who}{'' if self.settle else ' unsettled'}"


@dataclass(frozen=True)
class Config:
    loader: str
    workers: int
    shuffle: bool
    world: int
    events: tuple[Event, ...]
    every: int | None = 3
    every_seconds: float | None = None
    keep: int | None = 2
    async_save: bool = True
    mlflow: bool = False
    hold: str = "loader"  # what the state holds: the loader, or ("dataset") its dataset
    total: int = TOTAL
    seed: int | None = None  # the seed it was drawn from, if any

    def rank_cfg(self) -> dict[str, Any]:
        """What `resume_fns.train` reads."""
        d = asdict(self)
        d["events"] = [asdict(e) for e in self.events]
        return d

    def to_json(self) -> str:
        return json.dumps(self.rank_cfg(), separators=(",", ":"))

    @classmethod
    def from_json(cls, raw: str) -> Config:
        d = json.loads(raw)
        d["events"] = tuple(Event(**e) for e in d["events"])
        return cls(**d)

    def identity(self) -> tuple:
        """What the uninterrupted run depends on (not when or how it saves)."""
        return (self.loader, self.workers, self.shuffle, self.world, self.total)

    def describe(self) -> str:
        saves = [f"every={self.every}"] if self.every else []
        saves += [f"every_seconds={self.every_seconds}"] if self.every_seconds else []
        parts = [
            self.loader if self.hold == "loader" else f"{self.loader} (dataset held)",
            f"world={self.world}",
            f"workers={self.workers}",
            "shuffle" if self.shuffle else "in order",
            *saves,
            f"keep={self.keep}",
            "async" if self.async_save else "sync",
            "mlflow" if self.mlflow else "no mlflow",
        ]
        seed = f" (seed {self.seed})" if self.seed is not None else ""
        return f"{' '.join(parts)}: {' then '.join(e.describe() for e in self.events)}{seed}"

    def command(self) -> str:
        return (
            f"GANGRUN_RESUME_CONFIG='{self.to_json()}' python -m pytest -s "
            "tests/soak/test_resume_exactness.py::test_resume_search"
        )


def _step_for(rng: random.Random, every: int | None, lo: int, hi: int) -> int:
    """A step in [lo, hi]: half the time one just before or after a save or an epoch
    boundary."""
    special = {EPOCH_STEPS - 1, EPOCH_STEPS, 2 * EPOCH_STEPS - 1, 2 * EPOCH_STEPS}
    if every:
        special |= {m * every + d for m in range(1, TOTAL // every + 1) for d in (-1, 0)}
    near = sorted(s for s in special if lo <= s <= hi)
    if near and rng.random() < 0.5:
        return rng.choice(near)
    return rng.randint(lo, hi)


def draw(seed: int) -> Config:
    """The configuration of ``seed``."""
    rng = random.Random(seed)
    world = rng.choice([1, 2, 2, 3])
    how = rng.choice(["every", "every", "seconds", "both"])
    every = rng.randint(1, 5) if how != "seconds" else None
    every_seconds = rng.choice([0.02, 0.05, 0.2]) if how != "every" else None
    events: list[Event] = []
    n = 1 if rng.random() < 0.7 else 2
    lo = 0
    for k in range(n):
        hi = TOTAL - 1 - (n - 1 - k)  # room for the next one
        kind = rng.choice(KINDS)
        step = _step_for(rng, every, lo, hi)
        events.append(Event(kind, step, rng.randrange(world), rng.random() < 0.7))
        # a preemption saves the step after it: the next event comes later
        lo = step + (1 if kind in ("sigterm", "cancel") else 0)
    loader = rng.choice(LOADERS)
    return Config(
        loader=loader,
        workers=rng.randrange(4),
        shuffle=rng.random() < 0.7,
        world=world,
        events=tuple(events),
        every=every,
        every_seconds=every_seconds,
        keep=rng.choice([1, 2, 2, None]),
        async_save=rng.random() < 0.6,
        mlflow=rng.random() < 0.3,  # a tracked call costs 3-5 s more
        hold="dataset" if loader != "plain" and rng.random() < 0.35 else "loader",
        seed=seed,
    )


# ------------------------------------------------------------------------------ running
class Session:
    """The session's data (written once per loader and world size) and baselines' place."""

    def __init__(self, factory: Any) -> None:
        self.factory = factory
        self.made: dict[tuple[str, int], str] = {}

    def data(self, loader: str, world: int) -> str:
        key = (loader, world)
        if key not in self.made:
            root = str(self.factory.mktemp(f"resume-{loader}-{world}"))
            if loader == "volume":
                resume_fns.write_volume(root, world)
            elif loader == "table":
                resume_fns.write_table(root, world)
            self.made[key] = root
        return self.made[key]


def _opts(cfg: Config, **opts: Any) -> dict[str, Any]:
    """The call's options (JSON: a caller subprocess gets them too)."""
    base = {
        "processes": cfg.world,
        "timeout": CALL_TIMEOUT,
        "output": "none",
        "grace_period": 30,
        "restart_backoff": 0.1,
        "mlflow": cfg.mlflow,
        "forkserver": {"preload": PRELOAD + (["mlflow"] if cfg.mlflow else [])},
    }
    return {**base, **opts}


def _fn(cfg: Config, **opts: Any) -> Any:
    # one fork server for every call of this process (a caller subprocess preloads mlflow
    # only when it tracks: it starts its own server)
    opts = {**_opts(cfg, **opts), "forkserver": {"preload": [*PRELOAD, "mlflow"]}}
    return gangrun.distributed(**opts)(resume_fns.train)


def _trace(root: Path, world: int) -> dict[int, list[dict]]:
    out = {}
    for r in range(world):
        path = root / f"rank{r}.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        out[r] = [json.loads(x) for x in lines if x.strip()]
    return out


_baselines: dict[tuple, dict] = {}


def baseline(cfg: Config, data: str, sess: Session) -> dict:
    """The uninterrupted run of ``cfg``'s training: one save at its end (of the dataset,
    where there is one), MLflow off."""
    key = cfg.identity()
    if key not in _baselines:
        hold = "loader" if cfg.loader == "plain" else "dataset"
        plain = replace(
            cfg, events=(), every=None, every_seconds=None, keep=1, mlflow=False, hold=hold
        )
        root = sess.factory.mktemp("base")
        (root / "trace").mkdir(parents=True)
        out = _fn(plain, checkpoint_dir=str(root / "ckpt")).distributed(
            plain.rank_cfg(), data, str(root / "trace")
        )
        steps = {}
        for r, lines in _trace(root / "trace", cfg.world).items():
            steps[r] = {x["step"]: x for x in lines if "step" in x}
            assert sorted(steps[r]) == list(range(cfg.total)), "the uninterrupted run's trace"
        _baselines[key] = {"results": out, "steps": steps}
    return _baselines[key]


CALLER = """
import json, os, sys
sys.path.insert(0, {here!r})
import gangrun, resume_fns
cfg, data, trace, opts, idfile = json.loads(sys.argv[1])
handle = gangrun.distributed(**opts)(resume_fns.train).submit(cfg, data, trace)
open(idfile + ".tmp", "w").write(handle.mlflow_run_id or "")
os.replace(idfile + ".tmp", idfile)
handle.result()
"""


def _resume_option(line: str) -> dict[str, str]:
    """The option of a resume line ``f.options(run_id='...').distributed(...)``."""
    m = re.search(r"\.options\((run_id|checkpoint_dir)=('(?:[^'\\]|\\.)*')\)", line)
    assert m, f"no resume line in: {line[-2000:]}"
    return {m.group(1): ast.literal_eval(m.group(2))}


class Run:
    """One interrupted-and-continued run of a configuration, call after call."""

    def __init__(self, cfg: Config, data: str, tmp: Path, script: Any) -> None:
        self.cfg, self.data, self.tmp, self.script = cfg, data, tmp, script
        self.trace = tmp / "trace"
        self.trace.mkdir(parents=True)
        self.ckpt = str(tmp / "ckpt")
        self.run_id: str | None = None
        self.calls: list[str] = []  # what happened, for the failure message
        self.t0 = time.monotonic()

    def _args(self) -> tuple:
        return (self.cfg.rank_cfg(), self.data, str(self.trace))

    def _note(self, what: str) -> None:
        self.calls.append(f"{what} ({time.monotonic() - self.t0:.1f} s)")

    def _gate(self, i: int, what: str, ended: Any) -> None:
        """Wait until every rank is at gate ``i`` (``what``: "reached", or "stop": it saw
        the stop request); ``ended()`` says how the call ended, None while it runs."""
        files = [self.trace / f"gate{i}.{what}.{r}" for r in range(self.cfg.world)]

        def there() -> bool:
            if all(f.exists() for f in files):
                return True
            how = ended()
            assert how is None, f"the call ended before every rank was at gate {i} ({what}): {how}"
            return False

        _wait_for(there, f"gate {i} ({what})", timeout=CALL_TIMEOUT)

    @staticmethod
    def _proc_ended(proc: Any) -> str | None:
        if proc.poll() is None:
            return None
        _, err = proc.communicate(timeout=60)
        return f"the caller exited {proc.returncode}:\n{err[-3000:]}"

    @staticmethod
    def _handle_ended(handle: Any) -> str | None:
        if not handle.done():
            return None
        try:
            handle.result(timeout=0)
        except BaseException as exc:
            return f"{type(exc).__name__}: {exc}"
        return "it returned"

    def _open(self, i: int) -> None:
        (self.trace / f"gate{i}").touch()

    def _caller(self, i: int, ev: Event, where: dict[str, Any], restarts: int) -> dict:
        cfg = self.cfg
        opts = _opts(cfg, max_restarts=restarts, **where)
        idfile = str(self.tmp / f"run_id{i}")
        proc = self.script(CALLER.format(here=str(HERE)), json.dumps([*self._args(), opts, idfile]))
        try:
            self._gate(i, "reached", lambda: self._proc_ended(proc))
            _wait_for(lambda: os.path.exists(idfile), "the caller's run id")
            self.run_id = self.run_id or Path(idfile).read_text() or None
            if ev.kind == "caller_kill":
                proc.kill()
                proc.communicate(timeout=60)
                assert_no_survivors(proc.pid)
                self._open(i)  # done: a replay of the step passes it
                self._note(f"caller SIGKILLed at step {ev.step}")
                tracked = cfg.mlflow and self.run_id
                return {"run_id": self.run_id} if tracked else {"checkpoint_dir": self.ckpt}
            proc.send_signal(signal.SIGTERM)
            self._gate(i, "stop", lambda: self._proc_ended(proc))
            self._open(i)
            _, err = proc.communicate(timeout=CALL_TIMEOUT)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate(timeout=60)
        assert_no_survivors(proc.pid)
        assert proc.returncode == 1 and "DistributedPreemptedError" in err, (
            f"SIGTERM to the caller: exit {proc.returncode}\n{err[-3000:]}"
        )
        self._note(f"caller SIGTERMed at step {ev.step}, stopped")
        return _resume_option(err)

    def _cancel(self, i: int, ev: Event, where: dict[str, Any], restarts: int) -> dict:
        handle = _fn(self.cfg, max_restarts=restarts, **where).submit(*self._args())
        try:
            self.run_id = self.run_id or handle.mlflow_run_id
            self._gate(i, "reached", lambda: self._handle_ended(handle))
            assert handle.cancel(checkpoint=True, wait=0)
            self._gate(i, "stop", lambda: self._handle_ended(handle))
            self._open(i)
            with pytest.raises(gangrun.DistributedPreemptedError) as info:
                handle.result(timeout=CALL_TIMEOUT)
        finally:
            if not handle.done():
                handle.cancel(wait=30)
        self._note(f"cancelled at step {ev.step}: {info.value.resume}")
        return _resume_option(str(info.value.resume))

    def go(self) -> list[dict]:
        """Every call until the training ends; the last call's results."""
        events = self.cfg.events
        where: dict[str, Any] = {"checkpoint_dir": self.ckpt}
        i = 0
        while True:
            j = i
            while j < len(events) and events[j].kind == "rank_kill":
                j += 1
            restarts = j - i  # the rank kills this call meets
            if j == len(events):
                handle = _fn(self.cfg, max_restarts=restarts, **where).submit(*self._args())
                try:
                    self.run_id = self.run_id or handle.mlflow_run_id
                    out = handle.result(timeout=CALL_TIMEOUT)
                finally:
                    if not handle.done():
                        handle.cancel(wait=30)
                self._note(f"last call ({where}) ended")
                return out
            ev = events[j]
            if ev.kind == "cancel":
                where = self._cancel(j, ev, where, restarts)
            else:
                where = self._caller(j, ev, where, restarts)
            i = j + 1


# ------------------------------------------------------------------------------ comparing
def _close(cfg: Config, got: Any, want: Any) -> bool:
    """Bitwise equal (numbers or tensors); within `TOL3` with DDP over 3 ranks."""
    rtol, atol = TOL3
    if torch.is_tensor(got):
        exact = cfg.world < 3
        return bool(torch.equal(got, want) if exact else torch.allclose(got, want, rtol, atol))
    return got == want if cfg.world < 3 else abs(got - want) <= atol + rtol * abs(want)


def compare(cfg: Config, base: dict, out: list[dict], trace: dict, run_id: str | None) -> list:
    """What differs from the uninterrupted run (empty: nothing)."""
    problems: list[str] = []
    for r in range(cfg.world):
        want = base["steps"][r]
        seen: set[int] = set()
        first: dict[str, str] = {}
        start = None
        for line in trace[r]:
            if "start" in line:
                start = line["start"]
                continue
            s = line["step"]
            seen.add(s)
            b = want[s]
            diffs = {
                "batch": line["crc"] != b["crc"],
                "epoch": line["epoch"] != b["epoch"],
                "loss": not _close(cfg, float.fromhex(line["loss"]), float.fromhex(b["loss"])),
            }
            for what, bad in diffs.items():
                if bad and what not in first:
                    first[what] = f"from step {s} (in the attempt that started at {start})"
        for what, where in first.items():
            problems.append(f"rank {r}: {what} differs {where}")
        if missing := sorted(set(range(cfg.total)) - seen):
            problems.append(f"rank {r}: steps {missing} never ran")
    by_rank = {o["rank"]: o for o in out}
    for b in base["results"]:
        r, got = b["rank"], by_rank.get(b["rank"])
        if got is None:
            problems.append(f"rank {r}: no result")
            continue
        worst = {
            k: float((got["params"][k] - v).abs().max())
            for k, v in b["params"].items()
            if not _close(cfg, got["params"][k], v)
        }
        if worst:
            problems.append(f"rank {r}: parameters differ (max abs diff {worst})")
        for k in ("epoch", "epoch_ends"):
            if got[k] != b[k]:
                problems.append(f"rank {r}: final {k} {got[k]!r}, uninterrupted {b[k]!r}")
        if not _close(cfg, got["best"], b["best"]):
            problems.append(f"rank {r}: final best {got['best']!r}, uninterrupted {b['best']!r}")
    if cfg.mlflow:
        problems += _compare_history(cfg, base, run_id)
    return problems


def _compare_history(cfg: Config, base: dict, run_id: str | None) -> list[str]:
    if not run_id:
        return ["no MLflow run id"]
    hist = _history(run_id)
    steps = [s for s, _ in hist]
    twice = sorted({s for s in steps if steps.count(s) > 1})
    missing = sorted(set(range(cfg.total)) - set(steps))
    means = {s: float.fromhex(line["mean"]) for s, line in base["steps"][0].items()}
    wrong = sorted({s for s, v in hist if s in means and not _close(cfg, v, means[s])})
    out = []
    if twice:
        out.append(f"MLflow: steps {twice} logged more than once ({len(hist)} entries)")
    if missing:
        out.append(f"MLflow: steps {missing} missing")
    if wrong:
        out.append(f"MLflow: steps {wrong} with another loss than the uninterrupted run")
    return out


@dataclass
class Outcome:
    cfg: Config
    problems: list[str]
    calls: list[str]  # what happened, with the seconds since the interrupted run began
    base_s: float  # the uninterrupted run (0: cached)
    run_s: float  # the interrupted run, every call of it

    def report(self) -> str:
        head = f"{self.cfg.describe()} [{self.base_s:.1f} s + {self.run_s:.1f} s]"
        lines = [*self.problems, "calls: " + " / ".join(self.calls)]
        return head + "\n  " + "\n  ".join(lines) + f"\n  replay: {self.cfg.command()}"


def check(cfg: Config, sess: Session, tmp: Path, script: Any) -> Outcome:
    """Run ``cfg`` interrupted and continued; compare with the uninterrupted run."""
    data = sess.data(cfg.loader, cfg.world)
    t0 = time.monotonic()
    base = baseline(cfg, data, sess)
    t1 = time.monotonic()
    run = Run(cfg, data, tmp / "run", script)
    try:
        out = run.go()
    except BaseException as exc:
        if isinstance(exc, KeyboardInterrupt):
            raise
        problems = [f"a call failed: {type(exc).__name__}: {exc}"]
    else:
        problems = compare(cfg, base, out, _trace(run.trace, cfg.world), run.run_id)
    return Outcome(cfg, problems, run.calls, t1 - t0, time.monotonic() - t1)
