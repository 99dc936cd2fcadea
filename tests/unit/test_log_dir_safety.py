"""log_dir safety: ``make_private_dir`` and ``open_log``.

Another user is simulated by ``os.chown``/``os.lchown`` to uid 65534 (``nobody``): the test
machine runs as root, which may give files away. Run as an ordinary user these tests would
need that privilege; they are not skipped (the suite runs as root in CI).
"""

from __future__ import annotations

import os
import stat

import pytest

from gangrun.errors import LaunchError
from gangrun.wire.security import make_private_dir, open_log

OTHER = 65534


def _mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


@pytest.fixture
def umask022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def test_created_dirs_are_0700_whatever_the_umask(tmp_path, umask022):
    target = tmp_path / "shared" / "logs" / "run-1"
    assert make_private_dir(str(target)) == str(target)
    for d in (tmp_path / "shared", tmp_path / "shared" / "logs", target):
        assert _mode(d) == 0o700, d
        assert os.lstat(d).st_uid == os.getuid()
    os.umask(0o277)  # would make mkdir's result 0500: the mode is set explicitly
    assert make_private_dir(str(tmp_path / "u" / "v")) == str(tmp_path / "u" / "v")
    assert _mode(tmp_path / "u") == 0o700 and _mode(tmp_path / "u" / "v") == 0o700
    os.umask(0o022)
    # an existing directory of ours is accepted as it is (the user chose its mode)
    (tmp_path / "mine").mkdir(mode=0o755)
    make_private_dir(str(tmp_path / "mine"))
    assert _mode(tmp_path / "mine") == 0o755


def test_symlink_planted_at_log_dir_is_refused(tmp_path):
    """Another user plants the log_dir path as a symlink to their own directory."""
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o777)
    os.chown(theirs, OTHER, OTHER)
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    (shared / "logs").symlink_to(theirs)
    os.lchown(shared / "logs", OTHER, OTHER)
    with pytest.raises(LaunchError, match=r"logs.*symlink"):
        make_private_dir(str(shared / "logs"))
    # reached through it (the run directory below the planted link)
    with pytest.raises(LaunchError, match="symlink owned by another user"):
        make_private_dir(str(shared / "logs" / "run-1"))
    assert os.listdir(theirs) == []
    # even a link of ours is not accepted as the final component
    (tmp_path / "own-link").symlink_to(tmp_path / "shared")
    with pytest.raises(LaunchError, match="is a symlink"):
        make_private_dir(str(tmp_path / "own-link"))


def test_own_symlink_on_the_way_is_followed(tmp_path):
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to("real")  # relative, ours
    (tmp_path / "abs").symlink_to(real)  # absolute, ours
    make_private_dir(str(tmp_path / "link" / "a"))
    make_private_dir(str(tmp_path / "abs" / "b" / "c"))
    assert sorted(os.listdir(real)) == ["a", "b"]
    assert _mode(real / "b" / "c") == 0o700
    (tmp_path / "loop").symlink_to("loop")
    with pytest.raises(LaunchError, match="symlink"):
        make_private_dir(str(tmp_path / "loop" / "x"))


def test_dir_owned_by_another_user_is_refused(tmp_path):
    """A log_dir (or the run directory gangrun would create inside it) owned by uid 65534."""
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, OTHER, OTHER)
    with pytest.raises(LaunchError, match="owned by uid 65534"):
        make_private_dir(str(theirs))
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    os.chown(shared, OTHER, OTHER)
    with pytest.raises(LaunchError, match="belongs to uid 65534 and others can write it"):
        make_private_dir(str(shared / "run-1"))
    assert os.listdir(shared) == []
    # a file in the way
    (tmp_path / "file").write_text("x")
    with pytest.raises(LaunchError, match="not a directory"):
        make_private_dir(str(tmp_path / "file" / "run"))


def test_open_log_creates_private_file_and_appends(tmp_path, umask022):
    path = tmp_path / "rank-0.log"
    with open_log(str(path)) as f:
        f.write(b"one\n")
    assert _mode(path) == 0o600
    path.chmod(0o644)
    with open_log(str(path)) as f:
        f.write(b"two\n")
    assert path.read_bytes() == b"one\ntwo\n" and _mode(path) == 0o600


def test_open_log_refuses_symlinks_foreign_files_and_fifos(tmp_path):
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep")
    link = tmp_path / "rank-0.log"
    link.symlink_to(victim)
    with pytest.raises(LaunchError, match="symlink"):
        open_log(str(link))
    assert victim.read_bytes() == b"keep"
    dangling = tmp_path / "rank-1.log"
    dangling.symlink_to(tmp_path / "nowhere")
    with pytest.raises(LaunchError, match="symlink"):
        open_log(str(dangling))
    assert not (tmp_path / "nowhere").exists()
    foreign = tmp_path / "rank-2.log"
    foreign.write_bytes(b"")
    os.chown(foreign, OTHER, OTHER)
    with pytest.raises(LaunchError, match="owned by uid 65534"):
        open_log(str(foreign))
    fifo = tmp_path / "rank-3.log"
    os.mkfifo(fifo)
    with pytest.raises(LaunchError, match="FIFO"):  # and no hang waiting for a reader
        open_log(str(fifo))
