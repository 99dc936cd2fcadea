"""Caller side of checkpoints and preemption (docs/long_runs.md).

* `prepare`: before any rank starts, resolve where the call's checkpoints live (the
  ``checkpoint_dir`` option, or the location the resumed MLflow run recorded), prove it can be
  written, take it (one writer per location: `gangrun.checkpoint.writer`; a live call holding
  it is a LaunchError), refuse a resumed run whose recorded checkpoints are gone or all
  damaged, record it on the run; returns the ranks' environment. `release_location` gives the
  location back when the call ends (the supervisor's one teardown); its restarts keep it.
* `request_stop`: a preemption (``handle.cancel(checkpoint=True)``, SIGTERM to the
  caller): ask the ranks to checkpoint and stop through the run directory; if they have not
  all stopped within ``grace_period`` the call is cancelled as usual.
* `preempted_error`: what ranks that stopped after saving left, as the call's error.
* `preempted_waiting`: a preemption while no rank runs (the back-off before a restart): the
  call ends at once, to be resumed from the last complete checkpoint of its location.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import threading
import uuid
from types import FrameType
from typing import TYPE_CHECKING, Any, Protocol

from ..checkpoint.writer import WriterLock, acquire
from ..errors import DistributedPreemptedError, LaunchError
from ..wire import contract
from ..wire import stop as stop_files
from ..wire.rundir import RunDir
from ..wire.tags import TAG_DIR, TAG_LATEST

if TYPE_CHECKING:
    from ..options import Options
    from ..tracking.caller import Tracker


class Supervisor(Protocol):
    """What checkpoints need of the call (`lifecycle.supervisor.Supervisor`, which imports
    this module): its options and MLflow run, its run directory, and its end."""

    @property
    def run_id(self) -> str: ...
    @property
    def fn_name(self) -> str: ...
    @property
    def opts(self) -> Options: ...
    @property
    def tracker(self) -> Tracker | None: ...
    @property
    def rundir(self) -> RunDir | None: ...
    def done(self) -> bool: ...
    def wait(self, timeout: float | None = None) -> bool: ...
    def cancel(
        self, reason: str = "cancelled", wait: float = 30.0, checkpoint: bool = False
    ) -> bool: ...


log = logging.getLogger("gangrun.lifecycle.checkpoints")

_MARGIN_S = 2.0  # beyond grace_period: a rank's exit and the caller's reading of it
_held_lock = threading.Lock()
_held: dict[str, WriterLock] = {}  # call run id -> the location it holds


def _normalise(url: str) -> str:
    return url if "://" in url else os.path.abspath(os.path.expanduser(url))


def check_writable(url: str) -> None:
    """Create ``url`` and write (then delete) a probe file in it; a LaunchError if not."""
    from ..checkpoint import filesystem

    try:
        fs, path = filesystem(url)
        path = path.rstrip("/")
        fs.makedirs(path, exist_ok=True)
        probe = f"{path}/.gangrun-probe-{uuid.uuid4().hex[:8]}"
        fs.pipe_file(probe, b"ok")
        fs.rm_file(probe)
    except Exception as exc:
        raise LaunchError(
            f"checkpoint_dir={url!r} cannot be written: {type(exc).__name__}: {exc}. Name a "
            "directory or fsspec URL this process (and every rank) can write, with its "
            "credentials set (e.g. AWS_* variables, or fsspec's config)."
        ) from None


def prepare(sup: Supervisor) -> dict[str, str]:
    """The ranks' checkpoint environment (empty when the call has no checkpoints)."""
    opts, tracker = sup.opts, sup.tracker
    url = opts.checkpoint_dir
    recorded: dict[str, str] = {}
    if tracker is not None and tracker.resume_number > 0:
        recorded = _tags(tracker, required=url is None)
    if url is None and tracker is None and opts.run_id:
        raise LaunchError(
            f"run_id={opts.run_id!r}: that MLflow run could not be resumed (tracking is off "
            "for this call, see the note above), so where its checkpoints are is unknown and "
            "the ranks would start from step 0. Try again once the tracking store answers, or "
            "pass checkpoint_dir= with the run's checkpoint location."
        )
    if url is None:
        url = recorded.get(TAG_DIR)
        if url is None:
            return {}
    url = _normalise(url)
    check_writable(url)
    mlflow_id = None if tracker is None else str(tracker.run_id)
    lock = acquire(url, sup.run_id, sup.fn_name, mlflow_id)  # a live holder: a LaunchError
    try:
        env = _prepare_held(sup, url, recorded)
    except BaseException:
        lock.release()
        raise
    with _held_lock:
        _held[sup.run_id] = lock
    return env


def check_resume(opts: Options, run_id: str, tags: dict[str, str]) -> None:
    """Refuse, before the resumed MLflow run ``run_id`` is touched (its tracker calls this
    with the run's ``tags`` before taking it), what `prepare` would refuse once it is: a
    location that cannot be written, one a live call holds, recorded checkpoints that are
    gone or all damaged. A refused call thus leaves the run exactly as it was (its error
    tag, its resume count, its status)."""
    url = opts.checkpoint_dir or tags.get(TAG_DIR)
    if url is None:
        return
    url = _normalise(url)
    check_writable(url)
    from ..checkpoint import writer

    held = writer.holder(url)  # read only: `prepare` takes it once the run is this call's
    live = None if held is None else held.pop("live")
    if held is not None and live is not False:  # a dead holder is taken over by `prepare`
        rec = None if held.get("unreadable") else held
        raise LaunchError(writer.in_use_message(url, writer.lock_path(url), rec, live))
    _check_recorded(f"MLflow run {run_id}", url, tags)


def _check_recorded(run: str, url: str, recorded: dict[str, str]) -> None:
    """A LaunchError when ``run`` recorded checkpoints in ``url`` and none is usable now."""
    last = recorded.get(TAG_LATEST)
    if last and recorded.get(TAG_DIR, "").rstrip("/") == url.rstrip("/"):
        from ..checkpoint import integrity, latest

        if latest(url) is None:
            raise LaunchError(
                f"{run} recorded checkpoints in {url} (the last one {last}), but no complete "
                "checkpoint is there now: they were deleted or moved. Starting at step 0 would "
                "silently redo the training; pass checkpoint_dir= with their new location, or a "
                "fresh checkpoint_dir= to start over."
            )
        valid, damaged = integrity.newest_valid(url)  # listings and sizes: no data is read
        if valid is None:
            raise LaunchError(f"{run} cannot resume: {integrity.no_valid_message(url, damaged)}")


def _prepare_held(sup: Supervisor, url: str, recorded: dict[str, str]) -> dict[str, str]:
    tracker = sup.tracker
    _check_recorded(f"MLflow run {tracker.run_id if tracker else ''}", url, recorded)
    if tracker is not None:
        try:
            tracker.client.set_tag(tracker.run_id, TAG_DIR, url)
        except Exception as exc:
            log.warning("could not record the checkpoint location on the run: %s", exc)
    if threading.current_thread() is threading.main_thread():
        install_sigterm()
    return {contract.CHECKPOINT_DIR: url}


def release_location(run_id: str) -> None:
    """Give back the checkpoint location call ``run_id`` holds (none: nothing to do)."""
    with _held_lock:
        lock = _held.pop(run_id, None)
    if lock is not None:
        lock.release()


def location(run_id: str) -> str | None:
    """The checkpoint location call ``run_id`` of this process holds (for `gangrun ps`)."""
    with _held_lock:
        lock = _held.get(run_id)
    return None if lock is None else lock.url


def _tags(tracker: Tracker, required: bool) -> dict[str, str]:
    """The resumed run's tags as they were when this call took it (`Tracker.resumed_tags`).
    ``required``: they alone say where the checkpoints are, so not reading them is a
    LaunchError (the ranks would otherwise start with no checkpoint location)."""
    if tracker.resumed_tags is not None:
        return dict(tracker.resumed_tags)
    try:
        return dict(tracker.client.get_run(tracker.run_id).data.tags)
    except Exception as exc:
        if required:
            raise LaunchError(
                f"MLflow run {tracker.run_id} is resumed, but its tags (where its checkpoints "
                f"are) could not be read: {type(exc).__name__}: {exc}. Try again, or pass "
                "checkpoint_dir= with the run's checkpoint location."
            ) from None
        log.warning("could not read the resumed run's tags: %s", exc)
        return {}


# ---------------------------------------------------------------------- preemption
def request_stop(sup: Supervisor, wait: float | None) -> bool:
    """Ask the call's ranks to save and stop; cancel it if they have not within the grace
    period. True if the call was still running."""
    if sup.done() or sup.rundir is None:
        return False
    stop_files.request(sup.rundir)
    grace = float(sup.opts.grace_period) + _MARGIN_S

    def deadline() -> None:
        if not sup.wait(grace):
            sup.cancel(f"preempted, and the ranks did not checkpoint within {grace:g}s", wait=0)

    threading.Thread(target=deadline, name="gangrun-preempt", daemon=True).start()
    sup.wait(wait)
    return True


def preempted_error(
    rundir: RunDir, world: int, run_id: str, fn_name: str
) -> DistributedPreemptedError | None:
    """The call's DistributedPreemptedError when its ranks stopped after saving, else None."""
    records = {r: rec for r in range(world) if (rec := stop_files.read_stopped(rundir, r))}
    if not records:
        return None
    first = records[min(records)]
    step, ckpt, mlflow_id = first.step, first.checkpoint, first.mlflow_run_id
    line = resume_line(fn_name, mlflow_id, str(ckpt).rsplit("/", 1)[0])
    return DistributedPreemptedError(
        f"{fn_name} was preempted: every rank saved step {step} to {ckpt} and stopped. "
        f"Resume it with:\n    {line}",
        run_id=run_id,
        checkpoint=ckpt,
        step=step,
        mlflow_run_id=mlflow_id,
        resume=line,
    )


def resume_line(fn_name: str, mlflow_id: str | None, checkpoint_dir: str) -> str:
    """The one line that resumes a preempted call: its MLflow run, else its location."""
    if mlflow_id:
        return f"{fn_name}.options(run_id={mlflow_id!r}).distributed(...)"
    return f"{fn_name}.options(checkpoint_dir={checkpoint_dir!r}).distributed(...)"


def preempted_waiting(
    env: dict[str, str],
    fn_name: str,
    run_id: str,
    mlflow_id: str | None,
    where: str,
    after: str = "",
) -> DistributedPreemptedError:
    """The call's error for a preemption while no rank runs (``where``: "while waiting to
    restart (restart N)"; ``after``: a sentence on the failure before): nothing is left to
    save; the last complete checkpoint of the call's location (``env``: the ranks' checkpoint
    environment, `prepare`) is where a resume starts."""
    from ..checkpoint import latest

    url = env[contract.CHECKPOINT_DIR]
    try:
        ckpt, trouble = latest(url), ""
    except Exception as exc:  # storage unreachable: still a preemption, said so
        ckpt, trouble = None, f" (listing it failed: {type(exc).__name__}: {exc})"
    step = _step_of(ckpt)
    line = resume_line(fn_name, mlflow_id, url)
    if ckpt is not None:
        saved = f"the last complete checkpoint is step {step}, {ckpt}"
    else:
        saved = f"no checkpoint in {url} is complete{trouble}: a resume starts at step 0"
    return DistributedPreemptedError(
        f"{fn_name} was preempted {where}; no rank was running: {saved}.{after} Resume it "
        f"with:\n    {line}",
        run_id=run_id,
        checkpoint=ckpt,
        step=step,
        mlflow_run_id=mlflow_id,
        resume=line,
    )


def _step_of(ckpt: str | None) -> int | None:
    """N of a checkpoint ``.../step-N`` (the manager's names, rank/checkpointer.py)."""
    m = re.search(r"step-(\d+)/*$", ckpt or "")
    return int(m.group(1)) if m else None


_previous: Any = None
_sigterm_installed = False


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    from . import calls

    global _sigterm_installed
    signal.signal(signal.SIGTERM, _previous if _previous is not None else signal.SIG_DFL)
    _sigterm_installed = False  # a second SIGTERM: the previous behaviour (stop now)
    live = calls.active()
    ckpt = [c for c in live if c.ckpt_env]
    if not ckpt:
        if callable(_previous):
            _previous(signum, frame)
        else:
            os.kill(os.getpid(), signal.SIGTERM)
        return
    print("gangrun: SIGTERM: the ranks checkpoint and stop (send it again to stop now).")
    for c in live:
        if c in ckpt:
            threading.Thread(target=c.cancel, args=("preempted", 0.0, True), daemon=True).start()
        else:
            c.cancel("stopped by SIGTERM", wait=0.0)


def install_sigterm() -> None:
    """The caller's SIGTERM handler while calls with checkpoints run (main thread only)."""
    global _previous, _sigterm_installed
    if _sigterm_installed:
        return
    _previous = signal.getsignal(signal.SIGTERM)
    if _previous is _on_sigterm:
        _previous = None
    signal.signal(signal.SIGTERM, _on_sigterm)
    _sigterm_installed = True


__all__ = [
    "prepare",
    "release_location",
    "location",
    "check_writable",
    "request_stop",
    "preempted_error",
    "preempted_waiting",
    "resume_line",
    "install_sigterm",
]
