"""Tracking requests the caller makes, bounded in time (caller side).

MLflow retries a request to an unreachable server for about four minutes (seven retries with
exponential backoff, ``MLFLOW_HTTP_REQUEST_MAX_RETRIES``/``..._BACKOFF_FACTOR``), and a
finishing call makes several such requests. A call's results must not wait for that, and a
server that is not running must not hold up ``submit()``. So, for an ``http(s)`` tracking URI:

* `probe` asks the server's ``/health`` once, with a short timeout and no retries,
  before the run is created and before it is finished: a refused or silent server is known in
  seconds, and no MLflow request is made to it at all. It authenticates as MLflow would (the
  URI's ``user:password@``, or MLflow's variables), and every URI it says is `redact`-ed;
* `bounded` runs a sequence of MLflow requests in a helper thread and waits at most
  ``GANGRUN_TRACKING_TIMEOUT`` seconds (default 60) for it: past that the caller moves on (the
  thread, a daemon, ends when MLflow's own retries do);
* `HealthWatch` probes the server while the ranks run and says once, in one line, when
  it went away: the metrics the ranks log from then on are lost (they keep training).

Local stores (sqlite, files) are not probed: their failures are immediate errors.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Callable
from typing import IO, TYPE_CHECKING, Any, TypeVar
from urllib.parse import urlparse

from ..wire import contract
from ..wire.security import credentials, redact

if TYPE_CHECKING:
    import urllib.request

log = logging.getLogger("gangrun.tracking")

T = TypeVar("T")
DEFAULT_TIMEOUT = 60.0
PROBE_TIMEOUT = 3.0
WATCH_INTERVAL = 2.0


class TrackingTimeout(TimeoutError):
    """A tracking step did not finish within its time bound."""


def timeout_s() -> float:
    """``GANGRUN_TRACKING_TIMEOUT`` (seconds per tracking step), default 60."""
    from .. import settings

    return settings.seconds_in_force(contract.TRACKING_TIMEOUT, DEFAULT_TIMEOUT)


def is_server(uri: str) -> bool:
    return urlparse(uri).scheme in ("http", "https")


def health_request(uri: str) -> urllib.request.Request:
    """The ``/health`` request for the server at ``uri``, authenticated as MLflow's client
    would be: the URI's ``user:password@`` as HTTP basic authentication (not part of the
    host), else ``MLFLOW_TRACKING_USERNAME``/``MLFLOW_TRACKING_PASSWORD``, else
    ``MLFLOW_TRACKING_TOKEN`` as a bearer token."""
    import base64
    import urllib.request

    clean, user, password = credentials(uri)
    request = urllib.request.Request(clean.rstrip("/") + "/health")
    if user is None:
        user = os.environ.get("MLFLOW_TRACKING_USERNAME")
        password = os.environ.get("MLFLOW_TRACKING_PASSWORD")
        if user is None or password is None:
            user = None
    token = os.environ.get("MLFLOW_TRACKING_TOKEN")
    if user is not None:
        pair = f"{user}:{password or ''}".encode()
        request.add_header("Authorization", "Basic " + base64.b64encode(pair).decode("ascii"))
    elif token:
        request.add_header("Authorization", f"Bearer {token}")
    return request


def probe(uri: str, timeout: float = PROBE_TIMEOUT) -> str | None:
    """``None`` when the tracking server at ``uri`` answers (or ``uri`` is no server), else
    why it cannot be reached. One request, no retries."""
    if not is_server(uri):
        return None
    import urllib.error
    import urllib.request

    request = health_request(uri)
    url = request.full_url  # without the credentials: health_request took them off
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:  # noqa: S310 (http(s))
            reply.read(64)
        return None
    except urllib.error.HTTPError as exc:
        # It answered: a proxy or an auth layer in front of it; MLflow's own requests decide.
        log.debug("%s answered %s: treated as reachable", url, exc.code)
        return None
    except Exception as exc:  # refused, timed out, no route...
        reason = getattr(exc, "reason", None) or exc
        import ssl

        if isinstance(reason, ssl.SSLError):  # it answered; MLflow's own TLS settings decide
            log.debug("%s: TLS error %s: treated as reachable", url, reason)
            return None
        return f"{type(reason).__name__}: {reason}" if str(reason) else type(reason).__name__


def bounded(
    fn: Callable[[], T],
    what: str,
    timeout: float | None = None,
    on_late: Callable[[Any], None] | None = None,
) -> T:
    """``fn()`` in a helper thread; its result, or its exception re-raised. Raises
    `TrackingTimeout` when it has not finished within ``timeout`` seconds (default
    `timeout_s`); ``on_late(result)`` then runs in that thread if ``fn`` still returns
    later (e.g. ends a run that was created after the caller gave up on it)."""
    limit = timeout_s() if timeout is None else timeout
    done = threading.Event()
    lock = threading.Lock()
    box: dict[str, Any] = {}

    def work() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:
            box["error"] = exc
        with lock:
            late = box.get("abandoned", False)
            done.set()
        if late and on_late is not None and "value" in box:
            try:
                on_late(box["value"])
            except Exception as exc:
                log.debug("clean-up after a late %s failed: %s", what, exc)

    t = threading.Thread(target=work, name=f"gangrun-tracking-{what}", daemon=True)
    t.start()
    try:
        finished = done.wait(limit)
    except BaseException:  # interrupted while waiting: the late result is cleaned up
        with lock:
            box["abandoned"] = not done.is_set()
        if done.is_set() and on_late is not None and "value" in box:
            on_late(box["value"])
        raise
    with lock:
        if not done.is_set():
            box["abandoned"] = True
            finished = False
    if not finished:
        raise TrackingTimeout(f"{what} did not finish within {limit:g}s")
    t.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


class HealthWatch:
    """While the ranks run: probe the server every few seconds; the first time it does not
    answer, print one line to ``stream`` (metrics logged from then on are lost)."""

    def __init__(self, uri: str, stream: IO[str] | None, interval: float = WATCH_INTERVAL) -> None:
        self.uri = uri
        self.stream = stream
        self.interval = interval
        self.lost: str | None = None  # why, once the server stopped answering
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name="gangrun-tracking-watch", daemon=True
        )
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            why = probe(self.uri, timeout=min(PROBE_TIMEOUT, self.interval))
            if why is None or self._stop.is_set():
                continue
            self.lost = why
            line = (
                f"gangrun: the MLflow tracking server {redact(self.uri)} stopped answering ({why}): "
                "metrics the ranks log are being lost; the training goes on."
            )
            try:
                print(line, file=self.stream or sys.stderr, flush=True)
            except Exception:  # the caller's stream is closed: the log keeps it
                log.warning("%s", line)
            return  # told once

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(PROBE_TIMEOUT + 1.0)


__all__ = ["TrackingTimeout", "bounded", "probe", "is_server", "timeout_s", "HealthWatch"]
