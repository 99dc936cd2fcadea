"""``gangrun ps / logs / stacks / stop``: this user's calls on this node, from any terminal.

A call is found through its private run directory in the temp dir: the caller keeps a
record there (``call.json``) and serves a control socket (`gangrun.lifecycle.control`).
Only directories and records owned by this uid are read: another user's calls are invisible
(and their 0700 run directories unreachable anyway), so they can be neither listed nor
stopped. ``RUN`` is the call's run id (``handle.run_id``, first column of ``gangrun ps``) or
its MLflow run id, or a unique prefix of either of at least 4 characters (as git's short ids),
or the name of its function (``FUNCTION`` column: ``train``, ``fit`` for ``Trainer.fit``,
``train`` or ``train.py`` for a script) when that names one running call; a blank, shorter or
ambiguous ``RUN`` is a usage error (exit 2) that says what lists the ids, or which calls it
matches. ``ps --function NAME`` lists only that function's calls. ``ps`` shows,
under a call's row, the checkpoint location it holds (one writer per location:
docs/long_runs.md) and each rank's memory (resident memory of its process tree against its
limit, CUDA allocated/reserved; the rank nearest its limit marked; ``--json``: ``memory``).

``stop`` asks the caller to cancel the call: the same teardown as ``handle.cancel()`` in the
caller (every rank and descendant stopped, ``DistributedCancelledError`` naming who stopped
it, the MLflow run KILLED), done by the caller's own control thread, so it works while a
notebook kernel is busy running a cell. ``stacks`` asks the caller for every live rank's
Python stacks; the call keeps running.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from typing import Any

from ..wire import call as call_file
from ..wire import control
from ..wire import memory as memory_file
from ..wire.call import CallEntry
from ..wire.memory import MemorySample

EXIT_OK, EXIT_NOT_FOUND, EXIT_USAGE = 0, 1, 2
COMMANDS = ("ps", "logs", "stacks", "stop")
STALE_S = 5.0  # a memory sample older than this says its age (its rank is busy in C code)


@dataclass
class CallRef:
    """One call found on this node."""

    run_dir: str
    rec: CallEntry
    alive: bool  # its caller process is still the one that wrote the record

    @property
    def run_id(self) -> str:
        return self.rec.run_id

    @property
    def mlflow_run_id(self) -> str:
        return self.rec.mlflow_run_id or ""

    @property
    def state(self) -> str:
        if not self.alive and not self.rec.ended:
            return "caller gone"
        return self.rec.state or "?"

    @property
    def running(self) -> bool:
        return self.alive and not self.rec.ended


def _read_record(run_dir: str, uid: int) -> CallEntry | None:
    from ..wire.rundir import RunDir

    return call_file.read(RunDir(run_dir).call_record, uid)


def find_calls(tmp: str | None = None) -> list[CallRef]:
    """This uid's calls with a run directory in the temp dir, oldest first."""
    from ..host.system import own_dirs, process_identity

    uid = os.getuid()
    out: list[CallRef] = []
    for path in own_dirs(tmp or tempfile.gettempdir(), "gangrun-"):  # others': invisible
        rec = _read_record(path, uid)
        if rec is None:
            continue
        pid = rec.caller_pid
        alive = bool(pid) and process_identity(pid) == rec.caller
        out.append(CallRef(path, rec, alive))
    out.sort(key=lambda c: c.rec.started)
    return out


class Unknown(Exception):
    pass


class Usage(Unknown):
    """The ``RUN`` given cannot name one call (blank, too short, ambiguous): exit 2."""


MAX_TIMEOUT_S = 3600.0  # --timeout of stacks and stop
MIN_PREFIX = 4  # a shorter prefix would name a call by chance (as git's short ids)
_LISTS_IDS = "gangrun ps lists the run ids of your running calls (gangrun ps --all: ended ones too)"


def function_names(function: str) -> set[str]:
    """The names a call's function answers to: as recorded (``train``,
    ``Trainer.fit``), its last part (``fit``), and for a script its file name with and
    without ``.py`` (``train.py``, ``train``)."""
    if not function:
        return set()
    names = {function}
    if function.endswith(".py"):
        base = os.path.basename(function)
        names |= {base, base[: -len(".py")]}
    else:
        names.add(function.rsplit(".", 1)[-1])
    return names - {""}


def _listed(calls: list[CallRef]) -> str:
    return ", ".join(f"{c.run_id} ({c.rec.function or '?'}, {c.state})" for c in calls)


def resolve(run: str, calls: list[CallRef]) -> CallRef:
    """The call ``run`` names: its run id or MLflow run id, a unique prefix of one of them
    of at least `MIN_PREFIX` characters, or its function's name when that names one call
    (a running one before those that ended). Blank, too short or ambiguous: `Usage`."""
    want = run.strip()
    if not want:
        raise Usage(f"an empty run id ({run!r}) names no call; {_LISTS_IDS}")
    for c in calls:
        if want in (c.run_id, c.mlflow_run_id):  # (an empty MLflow run id matches nothing)
            return c
    named = [c for c in calls if want in function_names(c.rec.function)]
    named = [c for c in named if c.running] or named  # the live call(s) of that name first
    prefixed = (
        [c for c in calls if any(i.startswith(want) for i in (c.run_id, c.mlflow_run_id) if i)]
        if len(want) >= MIN_PREFIX
        else []
    )
    hits = named + [c for c in prefixed if not any(c is n for n in named)]
    if len(hits) == 1:
        return hits[0]
    if hits:
        more = "give more of the run id" if not named else "give the run id of one"
        raise Usage(f"{want!r} matches {len(hits)} calls: {_listed(hits)}; {more}")
    if len(want) < MIN_PREFIX:
        raise Usage(
            f"{want!r} is too short to name a call: give at least {MIN_PREFIX} characters of "
            f"its run id, or its function's name; {_LISTS_IDS}"
        )
    raise Unknown(
        f"no call of yours on this node matches {want!r} (gangrun ps lists them; another "
        "user's calls are neither shown nor stopped)"
    )


def _ask(c: CallRef, request: control.Request, timeout: float) -> control.Reply:
    """One request on the call's control socket; its answer."""
    from ..wire.rundir import RunDir

    path = RunDir(c.run_dir).control_socket
    try:
        reply = control.ask(path, request, timeout)
    except OSError as exc:
        raise Unknown(
            f"the caller of {c.run_id} (pid {c.rec.caller_pid}) does not answer on {path}: {exc}"
        ) from None
    except ValueError:
        raise Unknown(f"the caller of {c.run_id} closed the connection") from None
    if not reply.ok:
        raise Unknown(reply.error or "refused")
    return reply


def _elapsed(s: float) -> str:
    from ..progress_view import fmt_duration

    return fmt_duration(s)


def cmd_ps(ns: argparse.Namespace) -> int:
    calls = [c for c in find_calls() if ns.all or c.running]
    fn = (ns.function or "").strip() if ns.function is not None else None
    if fn is not None:
        if not fn:
            print("gangrun ps: --function needs a function's name", file=sys.stderr)
            return EXIT_USAGE
        calls = [c for c in calls if fn in function_names(c.rec.function)]
    if ns.json:
        # each with its ranks' last memory samples by rank ({} once the call ended)
        print(
            json.dumps(
                [
                    {
                        **replace(c.rec, state=c.state).to_dict(),
                        "memory": {str(r): s.to_dict() for r, s in sorted(_memory(c).items())},
                    }
                    for c in calls
                ],
                indent=2,
            )
        )
        return EXIT_OK
    if not calls:
        which = f" of function {fn!r}" if fn is not None else ""
        print(
            f"no running gangrun calls{which} of yours on this node"
            + ("" if ns.all else " (--all)")
        )
        return EXIT_OK
    rows = [("RUN", "FUNCTION", "RANKS", "GPUS", "ELAPSED", "STATE", "MLFLOW RUN", "CALLER")]
    now = time.time()
    for c in calls:
        r = c.rec
        gpus = ",".join(str(g) for g in r.gpus) or "-"
        state = c.state
        if r.max_restarts:
            state += f" ({r.attempt + 1}/{r.max_restarts + 1})"
        rows.append(
            (
                c.run_id,
                (r.function or "?")[:40],
                str(r.world_size or "?"),
                gpus,
                _elapsed(now - (r.started or now)),
                state,
                c.mlflow_run_id or "-",
                f"{r.caller_pid or None} {r.caller_kind}".strip(),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row, call in zip(rows, [None, *calls], strict=True):
        print("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip())
        held = call.rec.checkpoint_dir if call is not None and call.running else None
        if held:  # one writer per location: this call holds it (docs/long_runs.md)
            print(f"  checkpoints: {held} (held by this call)")
        if call is not None:
            for line in memory_lines(_memory(call), now):
                print(line)
    return EXIT_OK


def _memory(c: CallRef) -> dict[int, MemorySample]:
    """The running call's ranks' last memory samples."""
    return memory_file.read_all(c.run_dir, c.rec.world_size or 0) if c.running else {}


def memory_lines(samples: dict[int, MemorySample], now: float) -> list[str]:
    """``  memory: rank 0  1.2 GiB of 12 GiB (10%)`` then one line per other rank, the rank
    nearest its limit marked; a sample older than `STALE_S` says its age."""
    near = memory_file.nearest_limit(samples) if len(samples) > 1 else None
    out = []
    for i, (r, s) in enumerate(sorted(samples.items())):
        line = f"{'  memory:' if i == 0 else ' ' * 9} rank {r}  {s.text()}"
        if now - s.time > STALE_S:
            line += f" ({_elapsed(now - s.time)} ago)"
        if near is not None and near[0] == r:
            line += "  <- nearest its limit"
        out.append(line)
    return out


def _log_files(c: CallRef, rank: int | None) -> dict[int, str]:
    from ..wire.rundir import log_path

    n = c.rec.world_size
    log_dir = c.rec.log_dir or os.path.join(c.run_dir, "logs")
    if rank is not None and not 0 <= rank < n:
        raise Unknown(f"--rank must be in 0..{n - 1} for {c.run_id}, got {rank}")
    ranks = [rank] if rank is not None else list(range(n))
    return {r: log_path(log_dir, r) for r in ranks}


def cmd_logs(ns: argparse.Namespace, c: CallRef) -> int:
    files = _log_files(c, ns.rank)
    prefix = len(files) > 1
    offsets = dict.fromkeys(files, 0)
    partial = dict.fromkeys(files, b"")
    out = sys.stdout.buffer if hasattr(sys.stdout, "buffer") else None

    def emit(r: int, data: bytes, final: bool) -> None:
        data = partial[r] + data
        lines = data.split(b"\n")
        partial[r] = b"" if final else lines.pop()
        for line in lines:
            if final and not line:
                continue
            text = (f"[rank {r}] ".encode() if prefix else b"") + line + b"\n"
            if out is not None:
                out.write(text)
            else:
                sys.stdout.write(text.decode("utf-8", "replace"))
        sys.stdout.flush()

    def read_new(final: bool) -> None:
        for r, path in files.items():
            try:
                with open(path, "rb") as f:
                    f.seek(offsets[r])
                    data = f.read()
            except OSError:
                continue
            offsets[r] += len(data)
            if data or final:
                emit(r, data, final)

    try:
        while True:
            ended = not ns.follow or not _still_running(c)
            read_new(final=ended)
            if ended:
                return EXIT_OK
            time.sleep(0.25)
    except KeyboardInterrupt:
        return 130


def _still_running(c: CallRef) -> bool:
    from ..host.system import process_identity

    rec = _read_record(c.run_dir, os.getuid())
    if rec is None:
        return False
    c.rec = rec
    c.alive = process_identity(rec.caller_pid) == rec.caller
    return c.running


def cmd_stacks(ns: argparse.Namespace, c: CallRef) -> int:
    # the caller waits at most ns.timeout for the dumps; the socket allows for its answer
    request = control.Request(control.STACKS, timeout=ns.timeout)
    got = _ask(c, request, timeout=ns.timeout + 10).stacks
    if not got:
        print(f"gangrun: {c.run_id}: no live rank answered (still starting, or ending)")
        return EXIT_NOT_FOUND
    pids = c.rec.pids
    for r in sorted(got, key=int):
        print(f"--- rank {r} (pid {pids.get(r, '?')}) ---")
        print(got[r] or "(no stack dump: the rank did not answer SIGUSR1)")
    return EXIT_OK


def cmd_stop(ns: argparse.Namespace, c: CallRef) -> int:
    by = f"pid {os.getpid()}"
    reply = _ask(c, control.Request(control.STOP, by=by), timeout=ns.timeout)
    if not reply.done:
        print(f"gangrun: {c.run_id} is still stopping (asked {ns.timeout:g}s ago)")
        return EXIT_NOT_FOUND
    mlflow = reply.mlflow_run_id
    status = f"; MLflow run {mlflow} is {reply.mlflow_status}" if mlflow else ""
    print(
        f"gangrun: stopped {c.run_id} ({c.rec.function or None}): every rank was stopped{status}."
    )
    return EXIT_OK


def _duration(text: str) -> float:
    """``--timeout`` of stacks and stop: a duration as every gangrun channel takes it
    (``5``, ``2s``, ``1m``), more than 0 and at most `MAX_TIMEOUT_S`."""
    from ..durations import parse_duration

    try:
        wait = parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if wait is None or not 0 < wait <= MAX_TIMEOUT_S:
        raise argparse.ArgumentTypeError(
            f"must be more than 0 and at most {MAX_TIMEOUT_S:g} seconds, got {text!r}"
        )
    return wait


def add_node_commands(sub: Any) -> None:
    """The ``ps``, ``logs``, ``stacks`` and ``stop`` subcommands."""
    ps = sub.add_parser("ps", help="this user's running calls on this node")
    ps.add_argument("--all", action="store_true", help="also calls that ended (files kept)")
    ps.add_argument("--json", action="store_true", help="machine-readable output")
    ps.add_argument(
        "--function",
        metavar="NAME",
        default=None,
        help="only the calls of this function (train, Trainer.fit or fit, train.py or train)",
    )
    run_help = (
        "run id (gangrun ps), its MLflow run id, a unique prefix (4+ characters), or the "
        "function's name when one running call has it"
    )
    logs = sub.add_parser("logs", help="a call's rank output (every rank, or --rank N)")
    logs.add_argument("run", metavar="RUN", help=run_help)
    logs.add_argument("--rank", type=int, default=None, help="only this rank")
    logs.add_argument("--follow", "-f", action="store_true", help="keep printing until it ends")
    stacks = sub.add_parser("stacks", help="every rank's Python stacks (the call keeps running)")
    stacks.add_argument("run", metavar="RUN", help=run_help)
    stacks.add_argument(
        "--timeout", type=_duration, default=5.0, help="how long to wait for dumps (5s; 500ms: 0.5)"
    )
    stop = sub.add_parser("stop", help="stop a call, as handle.cancel() does in its caller")
    stop.add_argument("run", metavar="RUN", help=run_help)
    stop.add_argument(
        "--timeout", type=_duration, default=150.0, help="how long to wait for the end (150s)"
    )


def run_node_command(ns: argparse.Namespace) -> int:
    from .support import to_a_pipe

    return to_a_pipe(_dispatch, ns)  # `gangrun logs RUN | head`


def _dispatch(ns: argparse.Namespace) -> int:
    if ns.cmd == "ps":
        return cmd_ps(ns)
    try:
        calls = find_calls()
        if ns.cmd == "logs":
            return cmd_logs(ns, resolve(ns.run, calls))
        c = resolve(ns.run, [c for c in calls if c.running] or calls)
        if not c.running:
            print(f"gangrun {ns.cmd}: {c.run_id} is not running ({c.state})", file=sys.stderr)
            return EXIT_NOT_FOUND
        return cmd_stacks(ns, c) if ns.cmd == "stacks" else cmd_stop(ns, c)
    except Unknown as exc:
        print(f"gangrun {ns.cmd}: {exc}", file=sys.stderr)
        return EXIT_USAGE if isinstance(exc, Usage) else EXIT_NOT_FOUND


__all__ = [
    "COMMANDS",
    "CallRef",
    "add_node_commands",
    "find_calls",
    "function_names",
    "resolve",
    "run_node_command",
]
