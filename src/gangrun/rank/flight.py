"""The rank's half of reading torch's Flight Recorder (``TORCH_FR_BUFFER_SIZE``): for NCCL the
GPU-side state of the last collectives (an op launched on the host may still wait on the
device). `start` (called once an NCCL process group exists, when the recorder is on) runs one
thread that watches ``flight.request`` (four times a second) and, when the caller asks, writes
``torch._C._distributed_c10d._dump_fr_trace()``'s last entries to ``flight.<rank>``
(`gangrun.wire.flight`). The dump is torch's own, safe from any thread; the rank's main
thread may be stuck in a collective meanwhile.
"""

from __future__ import annotations

import os
import pickle
import threading
import time
from typing import Any

from ..wire import flight as flight_file

POLL_S = 0.25
_started = False


def enabled() -> bool:
    """torch keeps a Flight Recorder (its buffer size is set)."""
    for name in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"):
        try:
            if int(os.environ.get(name, "0") or 0) > 0:
                return True
        except ValueError:
            continue
    return False


def _dump() -> dict[str, Any]:
    import torch._C._distributed_c10d as c10d

    fn = getattr(c10d, "_dump_nccl_trace", None) or getattr(c10d, "_dump_fr_trace", None)
    if fn is None:
        return {}
    data = fn()
    return dict(pickle.loads(data)) if isinstance(data, bytes) else {}


def _serve(run_dir: str, rank: int) -> None:
    served = 0.0  # a request made before this thread ran is answered too
    while True:
        time.sleep(POLL_S)
        asked = flight_file.requested(run_dir)
        if asked <= served:
            continue
        served = asked
        try:
            flight_file.write(run_dir, flight_file.from_torch(rank, _dump()))
        except Exception:  # no dump this time; the verdict goes without it
            continue


def start(run_dir: str, rank: int) -> None:
    """Once per rank, when the Flight Recorder is on: the thread that answers the caller."""
    global _started
    if _started or not enabled():
        return
    _started = True
    try:
        flight_file.write(run_dir, flight_file.FlightDump(rank, 0.0, ()))  # will answer
    except OSError:
        return
    threading.Thread(
        target=_serve, args=(run_dir, rank), name="gangrun-flight-recorder", daemon=True
    ).start()


__all__ = ["enabled", "start"]
