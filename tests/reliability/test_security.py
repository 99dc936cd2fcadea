"""Security checks of the launcher (docs/security.md)."""

from __future__ import annotations

import os
import pickle
import stat
from pathlib import Path

import pytest
import rel_funcs

import gangrun
from gangrun import DistributedError
from gangrun.wire.security import UnsafePathError, load_private

SRC = Path(__file__).resolve().parents[2] / "src" / "gangrun"


def test_run_dir_and_files_are_private():
    fn = gangrun.distributed(processes=2, timeout=60)(rel_funcs.private_files)
    h = fn.submit()
    modes = h.result(60)[0]
    assert modes["."] == 0o700
    assert modes["logs"] == 0o700
    for name, mode in modes.items():
        assert mode & 0o077 == 0, f"{name} has mode {mode:o}"
    assert {"payload.pkl", "context.json", "logs/rank-0.log", "logs/rank-1.log"} <= set(modes)
    st = os.stat(h._run.run_dir)
    assert st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) == 0o700


def test_results_are_not_unpickled_from_a_dir_others_can_reach():
    fn = gangrun.distributed(processes=1, timeout=60)(rel_funcs.open_up_run_dir)
    with pytest.raises(DistributedError, match="could not be loaded") as ei:
        fn.distributed()
    assert ei.value.rank == 0
    assert isinstance(ei.value.__cause__, UnsafePathError)
    assert "mode 755" in str(ei.value)


def test_load_private_refuses_unsafe_paths(tmp_path):
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    d = tmp_path / "run"
    d.mkdir(mode=0o700)
    good = d / "ok.pkl"
    good.write_bytes(pickle.dumps(42))
    good.chmod(0o600)
    assert load_private(str(good)) == 42

    evil = d / "evil.pkl"
    evil.write_bytes(pickle.dumps(Evil()))
    evil.chmod(0o666)  # writable by others: never loaded
    with pytest.raises(UnsafePathError, match="other users can write"):
        load_private(str(evil))
    link = d / "link.pkl"
    link.symlink_to(good)
    with pytest.raises(UnsafePathError):
        load_private(str(link))
    d.chmod(0o755)
    with pytest.raises(UnsafePathError, match="must be 0700"):
        load_private(str(good))
    assert not marker.exists()


def test_user_strings_reach_ranks_verbatim_without_a_shell(tmp_path):
    marker = tmp_path / "pwned"
    nasty = f"$(touch {marker}); `touch {marker}` && echo 'x' \"y\" | tee {marker} # \\ \n end"
    fn = gangrun.distributed(processes=1, timeout=60, env={"SOAK_ECHO": nasty})(rel_funcs.echo)
    got = fn.distributed(nasty)[0]
    assert got["arg"] == nasty and got["env"] == nasty
    assert not marker.exists()


def test_no_shell_in_the_launcher_source():
    for path in SRC.rglob("*.py"):
        text = path.read_text()
        for bad in ("shell=True", "os.system(", "os.popen(", "commands.getoutput"):
            assert bad not in text, f"{path.name} uses {bad}"


@pytest.mark.slow
def test_rendezvous_on_loopback():
    fn = gangrun.distributed(processes=2, timeout=120)(rel_funcs.listening_sockets)
    for r in fn.distributed():
        assert r["master_addr"] == "127.0.0.1" and r["ifname"] == "lo"
        # gloo's own sockets are on loopback; torch's TCPStore (rank 0, MASTER_PORT) binds the
        # wildcard address whatever MASTER_ADDR says (documented in docs/security.md)
        for ip, port in r["listen"]:
            assert ip in ("127.0.0.1", "::1") or port == r["master_port"], (ip, port)


def test_log_dir_planted_by_another_user_is_refused_end_to_end(tmp_path):
    """A planted log_dir through a real call. Another user is simulated (the suite
    runs as root): a directory owned by uid 65534, reached through a symlink planted where the
    caller's ``log_dir`` would be created. The call fails before any rank starts, nothing is
    written into the other user's directory, and no run directory is left behind."""
    import tempfile

    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, 65534, 65534)
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    os.chmod(shared, 0o1777)  # a world-writable sticky dir, like /tmp
    (shared / "logs").symlink_to(theirs)
    os.lchown(shared / "logs", 65534, 65534)  # the link is theirs too
    before = set(os.listdir(tempfile.gettempdir()))
    fn = gangrun.distributed(processes=2, timeout=60, log_dir=str(shared / "logs"))
    with pytest.raises(gangrun.LaunchError, match="symlink|owned by"):
        fn(rel_funcs.private_files).distributed()
    assert os.listdir(theirs) == []
    leaked = {
        n for n in set(os.listdir(tempfile.gettempdir())) - before if n.startswith("gangrun-")
    }
    assert not leaked


def test_created_log_dir_is_private(tmp_path):
    """A ``log_dir`` gangrun creates (and the per-call directory in it) is 0700
    whatever the umask."""
    old = os.umask(0o022)
    try:
        fn = gangrun.distributed(processes=1, timeout=60, log_dir=str(tmp_path / "a" / "b"))
        h = fn(rel_funcs.private_files).submit()
        h.result(60)
    finally:
        os.umask(old)
    for d in (tmp_path / "a", tmp_path / "a" / "b", Path(h.log_dir)):
        assert stat.S_IMODE(os.stat(d).st_mode) == 0o700, d
