"""Every format that crosses a process boundary is a typed record of `gangrun.wire`.

Read with ``ast``: ``wire/`` imports nothing else of gangrun (but the public exceptions it
raises), the known writers of those formats never hand a ``dict`` to ``json.dump(s)`` or a
socket (each writes a record's serialization), and the MLflow names are spelled in
``wire/tags.py`` only. Then the records themselves: each reads what an earlier gangrun wrote
(a call started before an upgrade, a peer of another version), ignoring keys it does not know
and defaulting the ones it lacks.
"""

from __future__ import annotations

import ast
import json
import os
from pathlib import Path

import pytest

from gangrun.wire import call as call_file
from gangrun.wire import control, heartbeat, stop, tags
from gangrun.wire import progress as progress_file
from gangrun.wire import stacks as stack_file
from gangrun.wire.rundir import RunDir

SRC = Path(__file__).resolve().parents[2] / "src"
WIRE = SRC / "gangrun" / "wire"

# The modules that write or read a format of the run directory or the control socket.
WRITERS = [
    "gangrun/lifecycle/control.py",  # call.json, the control socket's replies
    "gangrun/cli/node.py",  # the control socket's requests
    "gangrun/lifecycle/checkpoints.py",  # stop.request
    "gangrun/rank/checkpointer.py",  # stop.<rank>.json
    "gangrun/rank/stop.py",
    "gangrun/launch/gang.py",  # stop.teardown
    "gangrun/rank/progress.py",  # progress.<rank>
    "gangrun/rank/memory.py",  # memory.<rank>
    "gangrun/rank/heartbeat.py",  # heartbeat.<rank>
    "gangrun/rank/stacks.py",  # stacks.<rank>
    "gangrun/rank/collectives.py",  # collectives.<rank>
    "gangrun/rank/flight.py",  # flight.<rank>
    "gangrun/lifecycle/hang.py",  # flight.request
    *sorted(str(p.relative_to(SRC)) for p in WIRE.glob("*.py")),
]
WIRE_RECORDS = {
    node.name
    for path in WIRE.glob("*.py")
    for node in ast.walk(ast.parse(path.read_text()))
    if isinstance(node, ast.ClassDef)
    and any(
        "dataclass" in ast.unparse(d) and "frozen=True" in ast.unparse(d)
        for d in node.decorator_list
    )
}
SERIALIZERS = {"to_json", "to_dict", "to_text", "to_bytes"}


# ------------------------------------------------------------------------- imports
def _gangrun_imports(path: Path) -> set[str]:
    """The gangrun modules ``path`` (a module of gangrun/wire) imports, resolved."""
    pkg = "gangrun.wire"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "gangrun"}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = pkg.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1])
                target = f"{base}.{node.module}" if node.module else base
            elif (node.module or "").split(".")[0] == "gangrun":
                target = str(node.module)
            else:
                continue
            found |= {f"{target}.{a.name}" if target == "gangrun" else target for a in node.names}
    return found


def _outside_wire(imports: set[str]) -> set[str]:
    return {m for m in imports if not (m == "gangrun.wire" or m.startswith("gangrun.wire."))}


def test_the_import_check_sees_relative_and_absolute_imports(tmp_path):
    mod = tmp_path / "m.py"
    mod.write_text(
        "from ..host import system\nfrom . import rundir\nimport gangrun.options\n"
        "def f():\n    from ..errors import LaunchError\n"
    )
    assert _outside_wire(_gangrun_imports(mod)) == {
        "gangrun.host",
        "gangrun.options",
        "gangrun.errors",
    }


def test_wire_imports_nothing_else_of_gangrun():
    bad = []
    for path in sorted(WIRE.glob("*.py")):
        for mod in sorted(_outside_wire(_gangrun_imports(path))):
            bad.append(f"{path.relative_to(SRC)} imports {mod}")
    assert not bad, (
        "wire/ is the bottom of gangrun: every process reads its formats without loading "
        "anything else. Move what it needs into wire/, or pass it in:\n" + "\n".join(bad)
    )


# ------------------------------------------------------------------------- records
def _serialized(node: ast.AST, records: dict[str, str]) -> bool:
    """``node`` holds a record's serialization: ``x.to_json()`` (or to_dict, to_text,
    to_bytes) somewhere in it, or is a name annotated with a record class of gangrun.wire; and
    no dict display of its own."""
    if isinstance(node, ast.Name):
        return records.get(node.id, "") in WIRE_RECORDS
    if isinstance(node, (ast.Dict, ast.DictComp)):
        return False
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "dict":
        return False
    return any(
        isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in SERIALIZERS
        for n in ast.walk(node)
    )


def dict_writes(source: str, name: str = "<src>") -> list[str]:
    """``json.dump(s)``, ``send``/``sendall`` and ``pwrite`` calls whose payload is not a
    record's serialization. A record's own serializer (a method named ``to_json``...) may
    dump the dict it builds: that is the record's wire form."""
    tree = ast.parse(source, name)
    allowed: set[int] = set()
    annotated: dict[int, dict[str, str]] = {}  # call -> its function's parameters' annotations
    for fn in ast.walk(tree):
        if not isinstance(fn, ast.FunctionDef):
            continue
        if fn.name in SERIALIZERS:
            allowed |= {id(n) for n in ast.walk(fn)}
        params = {a.arg: ast.unparse(a.annotation) for a in fn.args.args if a.annotation}
        for n in ast.walk(fn):
            annotated[id(n)] = params
    bad = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or id(node) in allowed or not node.args:
            continue
        func = node.func
        if not isinstance(func, ast.Attribute):
            continue
        owner = func.value.id if isinstance(func.value, ast.Name) else ""
        if owner == "json" and func.attr in ("dump", "dumps"):
            payload = node.args[0]
        elif func.attr in ("send", "sendall") and owner != "json":
            payload = node.args[-1]
        elif owner == "os" and func.attr == "pwrite":
            payload = node.args[1]
        else:
            continue
        if not _serialized(payload, annotated.get(id(node), {})):
            bad.append(f"{name}:{node.lineno}: {ast.unparse(node)[:80]}")
    return bad


def test_the_dict_check_finds_what_it_looks_for():
    old = """
import json
def reply(conn, msg):
    conn.sendall(json.dumps(msg).encode() + b"\\n")
def ask(s):
    s.sendall(json.dumps({"op": "stop"}).encode() + b"\\n")
def write(f, step):
    json.dump({"step": step}, f)
    os.pwrite(fd, line.encode(), 0)
class R:
    def to_json(self):
        return json.dumps({"a": 1})
def fine(conn, req, msg: Reply):
    conn.sendall(req.to_json().encode())
    send(conn, msg)
    print(json.dumps([r.to_dict() for r in rs]))
"""
    got = sorted(dict_writes(old), key=lambda g: int(g.split(":")[1]))
    # the socket writes and the dumps inside them; the bare dump; the string's bytes
    assert [g.split(":")[1] for g in got] == ["4", "4", "6", "6", "8", "9"], got
    assert "pwrite" in got[-1]
    assert "Reply" in WIRE_RECORDS and "CallEntry" in WIRE_RECORDS


def test_no_dict_record_crosses_a_process_boundary():
    bad = []
    for rel in WRITERS:
        path = SRC / rel
        bad += dict_writes(path.read_text(), rel)
    assert not bad, (
        "a format that crosses a process boundary is a record of gangrun.wire: write "
        "record.to_json() (its reader is next to it), not a dict:\n" + "\n".join(bad)
    )


def test_mlflow_names_are_spelled_in_wire_tags_only():
    names = {v for k, v in vars(tags).items() if k.startswith("TAG_")}
    bad = []
    for path in sorted((SRC / "gangrun").rglob("*.py")):
        if path == WIRE / "tags.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Constant) and node.value in names:
                bad.append(f"{path.relative_to(SRC)}:{node.lineno}: {node.value!r}")
    assert not bad, "use the constant of gangrun.wire.tags:\n" + "\n".join(bad)
    assert set(names) <= set(tags.TABLE), "every tag is in the table"


def test_the_terminal_states_are_the_ends_of_the_state_machine():
    from gangrun.lifecycle.state import TRANSITIONS, State

    ends = {s.value for s in State if s not in TRANSITIONS}  # no way out
    assert ends == set(call_file.ENDED)
    assert {s.value for s in State if s.terminal} == ends


# ------------------------------------------------------------------------- readers
def test_a_call_record_of_another_version_is_read(tmp_path):
    entry = call_file.CallEntry(run_id="abc", function="train", world_size=2, pids={"0": 7})
    path = str(tmp_path / "call.json")
    call_file.write(path, entry)
    assert oct(os.stat(path).st_mode & 0o777) == "0o600"
    assert call_file.read(path, os.getuid()) == entry
    assert call_file.read(path, os.getuid() + 1) is None  # another user's: not read
    old = {"run_id": "x", "state": "running", "caller_pid": "12", "new_key": [1], "gpus": None}
    (tmp_path / "old.json").write_text(json.dumps(old))
    got = call_file.read(str(tmp_path / "old.json"), os.getuid())
    assert got is not None and (got.run_id, got.state, got.caller_pid) == ("x", "running", 12)
    assert got.gpus == [] and got.pids == {} and not got.ended
    (tmp_path / "bad.json").write_text(json.dumps({"world_size": "two", "pids": [1]}))
    bad = call_file.read(str(tmp_path / "bad.json"), os.getuid())
    assert bad == call_file.CallEntry()  # mistyped values: their defaults
    (tmp_path / "list.json").write_text("[]")
    assert call_file.read(str(tmp_path / "list.json"), os.getuid()) is None


def test_control_messages_round_trip_and_read_an_older_peer():
    req = control.Request(control.STACKS, timeout=2.5)
    assert control.Request.from_json(req.to_json()) == req
    assert json.loads(control.Request(control.STOP, by="pid 1").to_json()) == {
        "op": "stop",
        "by": "pid 1",
    }
    assert control.Request.from_json(b'{"op": "stacks", "timeout": "nan?"}').timeout is None
    assert control.Request.from_json(b"not json") is None
    assert control.Request.from_json(b"[1]") == control.Request(op="")
    old_stop = {"ok": True, "done": True, "state": "cancelled", "mlflow_status": "KILLED"}
    reply = control.Reply.from_json(json.dumps({**old_stop, "extra": 1}))
    assert reply.done and reply.state == "cancelled" and reply.mlflow_run_id is None
    assert json.loads(control.Reply(ok=False, error="refused").to_json()) == {
        "ok": False,
        "error": "refused",
    }
    with pytest.raises(ValueError):
        control.Reply.from_json(b"")


def test_stop_files(tmp_path):
    rd = RunDir(str(tmp_path))
    assert not stop.requested(rd) and stop.read_request(rd) is None
    req = stop.request(rd, at=12.5)
    assert stop.requested(rd) and stop.read_request(rd) == req
    assert not stop.tearing_down(rd)
    stop.mark_teardown(rd)
    assert stop.tearing_down(rd)
    rec = stop.Stopped(step=40, checkpoint="/c/step-40", time=1.0, mlflow_run_id=None)
    stop.write_stopped(rd, 1, rec)
    assert stop.read_stopped(rd, 1) == rec and stop.read_stopped(rd, 0) is None
    with open(rd.stopped(0), "w") as f:  # an older writer's record: a bare dict, more keys
        json.dump({"step": "7", "checkpoint": "/c/step-7", "host": "h"}, f)
    assert stop.read_stopped(rd, 0) == stop.Stopped(step=7, checkpoint="/c/step-7")


def test_step_report_heartbeat_and_stacks_files(tmp_path):
    run_dir = str(tmp_path)
    rep = progress_file.StepReport(3, 10, None, 5, 0, 100.0, 101.0, True, 4)
    raw = rep.to_bytes()
    assert len(raw) == progress_file.SIZE
    with open(RunDir(run_dir).progress(3), "wb") as f:
        f.write(raw)
    assert progress_file.read(run_dir, 3) == rep
    assert heartbeat.read(run_dir, 0) is None
    heartbeat.touch(heartbeat.path(run_dir, 0))
    beat = heartbeat.read(run_dir, 0)
    assert beat is not None and beat.rank == 0 and beat.time > 0
    assert not stack_file.ready(run_dir, 1)
    f = stack_file.open_unpublished(run_dir, 1)
    stack_file.publish(run_dir, 1)
    assert stack_file.ready(run_dir, 1) and stack_file.size(run_dir, 1) == 0
    f.write('Thread 0x1 (most recent call first):\n  File "x.py", line 1 in f\n')
    f.close()
    assert stack_file.read_since(run_dir, 1, 0).text.startswith("Thread 0x1")
    assert stack_file.read_since(run_dir, 2, 0) == stack_file.StackDump(2, "")
