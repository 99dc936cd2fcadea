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
docs/long_runs.md).

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
import socket
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

EXIT_OK, EXIT_NOT_FOUND, EXIT_USAGE = 0, 1, 2
COMMANDS = ("ps", "logs", "stacks", "stop")
_ENDED = ("succeeded", "failed", "cancelled", "timed_out", "hung")


@dataclass
class CallRef:
    """One call found on this node."""

    run_dir: str
    rec: dict[str, Any]
    alive: bool  # its caller process is still the one that wrote the record

    @property
    def run_id(self) -> str:
        return str(self.rec.get("run_id") or "")

    @property
    def mlflow_run_id(self) -> str:
        return str(self.rec.get("mlflow_run_id") or "")

    @property
    def state(self) -> str:
        state = str(self.rec.get("state") or "?")
        if not self.alive and state not in _ENDED:
            return "caller gone"
        return state

    @property
    def running(self) -> bool:
        return self.alive and self.state not in _ENDED


def _read_record(run_dir: str, uid: int) -> dict[str, Any] | None:
    from ..wire.rundir import RunDir

    try:
        fd = os.open(RunDir(run_dir).call_record, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if os.fstat(fd).st_uid != uid:
            return None
        with os.fdopen(fd, "rb", closefd=False) as f:
            raw = json.loads(f.read(1 << 20))
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)
    return raw if isinstance(raw, dict) else None


def find_calls(tmp: str | None = None) -> list[CallRef]:
    """This uid's calls with a run directory in the temp dir, oldest first."""
    from ..host.system import own_dirs, process_identity

    uid = os.getuid()
    out: list[CallRef] = []
    for path in own_dirs(tmp or tempfile.gettempdir(), "gangrun-"):  # others': invisible
        rec = _read_record(path, uid)
        if rec is None:
            continue
        pid = int(rec.get("caller_pid") or 0)
        alive = bool(pid) and process_identity(pid) == rec.get("caller")
        out.append(CallRef(path, rec, alive))
    out.sort(key=lambda c: float(c.rec.get("started") or 0))
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
    return ", ".join(f"{c.run_id} ({c.rec.get('function') or '?'}, {c.state})" for c in calls)


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
    named = [c for c in calls if want in function_names(str(c.rec.get("function") or ""))]
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


def _ask(c: CallRef, request: dict[str, Any], timeout: float) -> dict[str, Any]:
    """One request on the call's control socket; its answer."""
    from ..wire.rundir import RunDir

    path = RunDir(c.run_dir).control_socket
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect(path)
        try:
            s.sendall(json.dumps(request).encode() + b"\n")
        except (BrokenPipeError, ConnectionResetError):
            pass  # refused before the request was read: the answer says why
        line = s.makefile("rb").readline()
    except OSError as exc:
        raise Unknown(
            f"the caller of {c.run_id} (pid {c.rec.get('caller_pid')}) does not answer on "
            f"{path}: {exc}"
        ) from None
    finally:
        s.close()
    try:
        reply = json.loads(line)
    except ValueError:
        raise Unknown(f"the caller of {c.run_id} closed the connection") from None
    if not reply.get("ok"):
        raise Unknown(str(reply.get("error") or "refused"))
    return dict(reply)


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
        calls = [c for c in calls if fn in function_names(str(c.rec.get("function") or ""))]
    if ns.json:
        print(json.dumps([dict(c.rec, state=c.state) for c in calls], indent=2))
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
        gpus = ",".join(str(g) for g in r.get("gpus") or []) or "-"
        state = c.state
        if int(r.get("max_restarts") or 0):
            state += f" ({int(r.get('attempt') or 0) + 1}/{int(r['max_restarts']) + 1})"
        rows.append(
            (
                c.run_id,
                str(r.get("function") or "?")[:40],
                str(r.get("world_size") or "?"),
                gpus,
                _elapsed(now - float(r.get("started") or now)),
                state,
                c.mlflow_run_id or "-",
                f"{r.get('caller_pid')} {r.get('caller_kind') or ''}".strip(),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row, call in zip(rows, [None, *calls], strict=True):
        print("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip())
        held = call.rec.get("checkpoint_dir") if call is not None and call.running else None
        if held:  # one writer per location: this call holds it (docs/long_runs.md)
            print(f"  checkpoints: {held} (held by this call)")
    return EXIT_OK


def _log_files(c: CallRef, rank: int | None) -> dict[int, str]:
    from ..wire.rundir import log_path

    n = int(c.rec.get("world_size") or 0)
    log_dir = str(c.rec.get("log_dir") or os.path.join(c.run_dir, "logs"))
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
    c.alive = process_identity(int(rec.get("caller_pid") or 0)) == rec.get("caller")
    return c.running


def cmd_stacks(ns: argparse.Namespace, c: CallRef) -> int:
    # the caller waits at most ns.timeout for the dumps; the socket allows for its answer
    reply = _ask(c, {"op": "stacks", "timeout": ns.timeout}, timeout=ns.timeout + 10)
    got = reply.get("stacks") or {}
    if not got:
        print(f"gangrun: {c.run_id}: no live rank answered (still starting, or ending)")
        return EXIT_NOT_FOUND
    pids = c.rec.get("pids") or {}
    for r in sorted(got, key=int):
        print(f"--- rank {r} (pid {pids.get(r, '?')}) ---")
        print(got[r] or "(no stack dump: the rank did not answer SIGUSR1)")
    return EXIT_OK


def cmd_stop(ns: argparse.Namespace, c: CallRef) -> int:
    by = f"pid {os.getpid()}"
    reply = _ask(c, {"op": "stop", "by": by}, timeout=ns.timeout)
    if not reply.get("done"):
        print(f"gangrun: {c.run_id} is still stopping (asked {ns.timeout:g}s ago)")
        return EXIT_NOT_FOUND
    mlflow = reply.get("mlflow_run_id")
    status = f"; MLflow run {mlflow} is {reply.get('mlflow_status')}" if mlflow else ""
    print(f"gangrun: stopped {c.run_id} ({c.rec.get('function')}): every rank was stopped{status}.")
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
