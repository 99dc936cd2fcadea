"""A full disk said as such, without mounting anything: ``/dev/full``
answers every write with a real ``ENOSPC`` from the kernel. The tests on a mounted tmpfs are
in tests/reliability/test_disk_and_forkserver.py."""

from __future__ import annotations

import errno
import os

import pytest

from gangrun import LaunchError
from gangrun.host import diskspace
from gangrun.wire import diskfull, serialization

pytestmark = pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full")


def test_payload_on_a_full_disk_is_a_launch_error_naming_the_directory():
    with pytest.raises(LaunchError) as caught:
        serialization.write_payload("/dev/full", len, (b"x" * (2 << 20),), {})
    msg = str(caught.value)
    assert "cannot be serialized" not in msg, msg
    assert "could not write the call's payload: the disk of /dev is full" in msg, msg
    assert isinstance(caught.value.__cause__, OSError)
    assert caught.value.__cause__.errno == errno.ENOSPC


def test_only_no_room_counts_as_a_full_disk():
    assert diskfull.is_full(OSError(errno.ENOSPC, "No space left on device"))
    assert diskfull.is_full(OSError(errno.EDQUOT, "Disk quota exceeded"))
    assert not diskfull.is_full(OSError(errno.EACCES, "Permission denied"))
    assert not diskfull.is_full(TypeError("cannot pickle"))
    assert diskspace.free_bytes("/nonexistent/dir") is None
