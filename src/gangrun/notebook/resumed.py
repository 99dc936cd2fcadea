"""The step a running attempt resumed from, for the panel ("attempt 2/4, resumed from step
1200"): read from the ranks' step reports (`gangrun.rank.progress`; the checkpoint manager
reports a completed restore with ``progress.report_resumed``)."""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

from ..wire import progress
from .state import CallState

if TYPE_CHECKING:
    from ..lifecycle.observers import CallView

log = logging.getLogger("gangrun.notebook")


class ResumeWatch:
    """A daemon thread that reads the run directory's step reports every ``interval``
    seconds while the call runs and tells the `CallState` the resumed step."""

    def __init__(self, state: CallState, run: CallView, interval: float = 1.0) -> None:
        self.state, self.run, self.interval = state, run, interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="gangrun-resume", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(2.0)  # at most one poll of a few small files away

    def poll(self) -> None:
        run_dir, world = getattr(self.run, "run_dir", ""), getattr(self.run, "world_size", 0)
        if not run_dir or not world:
            return
        reports = progress.read_all(run_dir, world).values()
        steps = [r.resumed_from for r in reports if r.resumed_from is not None]
        if steps:
            worlds = [r.saved_world for r in reports if r.saved_world is not None]
            self.state.resumed(min(steps), worlds[0] if worlds else None)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.poll()
            except Exception:  # the panel line is best effort
                log.debug("panel: cannot read the step reports", exc_info=True)


__all__ = ["ResumeWatch"]
