"""The launch machinery's part inside a rank process (imports only the rank side + platform).

Every rank, however started, is the child subreaper of its descendants: a helper that left
the rank's session and environment (``start_new_session=True``, its own ``env``) still
re-parents to the rank when its own parent ends, and is killed when the rank ends through
gangrun's exit path, so no helper outlives its rank. C stdio is flushed on that path too: a
rank's last lines written by C code are not lost when it ends.
"""

from __future__ import annotations

from ..host import system as platform


def _end_descendants() -> None:
    platform.kill_children()


def prepare_rank() -> None:
    """Called first thing in a rank (fresh interpreter, forked child, Ray rank)."""
    from . import worker

    platform.become_subreaper()
    worker.before_exit.insert(0, _end_descendants)


def boot() -> None:
    """Entry point of a fresh-interpreter rank."""
    from . import worker

    prepare_rank()
    worker.main()
