"""Was a SIGKILLed rank killed by the kernel's out-of-memory killer? The caller's verdict, with
figures, from what the host offers once the rank is dead:

- the kernel log (``/dev/kmsg``, where this user may read it): "Killed process PID ...
  anon-rss:...kB" and its "oom-kill:... task_memcg=..." line: certain, with the resident
  memory at the kill;
- the memory cgroup the rank was in (from its last memory sample, `gangrun.wire.memory`: the
  pid is gone by now): its ``oom_kill`` counter (v2 ``memory.events``, v1
  ``memory.oom_control``) rose since that sample: certain; its limit and peak are the figures;
- the last sample alone: resident memory near the limit says "probably".

The same for a rank that raised because one of its DataLoader workers died
(`explain_worker`: torch's "DataLoader worker (pid N) is killed by signal: Killed"). Nothing
of the host is read unless a rank died of SIGKILL or so.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..host import memory as host
from ..wire import memory as memory_file
from ..wire.memory import MemorySample, fmt_bytes

NEAR_LIMIT = 0.85  # a last sample at this share of the limit or more: "probably"
SAMPLE_SLACK_S = 5.0  # kills logged from this long before the rank's last sample on count


@dataclass(frozen=True)
class OomVerdict:
    """What the host says of a SIGKILL: ``certain`` (the kernel log or the cgroup's counter
    recorded the kill) or probable (only the memory trend), and the figures."""

    certain: bool
    rss: int | None  # bytes resident at the kill (or the cgroup's peak, or the last sample)
    limit: int | None  # bytes
    cgroup: str | None  # the memory cgroup whose limit applied ("" : the machine's memory)
    peak: int | None = None  # bytes: the cgroup's peak use (its processes, its page cache)
    growth: float | None = None  # bytes per second at the last sample (a probable verdict)

    def text(self, who: str) -> str:
        """``<who> was killed by the out-of-memory killer: 11.2 GiB resident of a 12 GiB
        limit (memory cgroup /a/b)``, ``who`` naming the rank."""
        figures = ""
        if self.rss is not None and self.limit:
            figures = f": {fmt_bytes(self.rss)} resident of a {fmt_bytes(self.limit)} limit"
        elif self.rss is not None:
            figures = f": {fmt_bytes(self.rss)} resident"
        where = ""
        if self.cgroup:
            where = f" (memory cgroup {self.cgroup}"
            if (
                self.peak
                and self.rss
                and self.limit
                and abs(self.peak - self.rss) > self.limit / 10
            ):
                # pages it shares with the process it was forked from are charged there
                where += f"; {fmt_bytes(self.peak)} charged to it at the peak"
            where += ")"
        elif self.cgroup == "":
            where = " (the machine's memory)"
        if self.certain:
            return f"{who} was killed by the out-of-memory killer{figures}{where}"
        figures = figures.replace(": ", ": last sampled at ", 1)
        if figures and self.growth and self.growth > 0:
            figures += f", growing {fmt_bytes(self.growth)}/s"
        return f"{who} was killed by SIGKILL, probably by the out-of-memory killer{figures}{where}"


def judge(
    last: MemorySample | None,
    kernel: host.KernelKill | None,
    now: host.CgroupMemory | None,
    kernel_log_read: bool = False,
    died_at: float | None = None,
) -> OomVerdict | None:
    """The verdict from the facts (pure: tests give them): the rank's last memory sample,
    the kernel log's record of the kill, its memory cgroup's figures now, whether the kernel
    log could be read at all, and when the rank died (the last sample's growth carried on to
    then may reach the limit: "probably"). A kernel log that was read and records no kill of
    the rank rules the out-of-memory killer out (a rise of the cgroup's counter, which the
    other processes of the cgroup share, is then another process's kill)."""
    cgroup = last.cgroup if last is not None else None
    limit = now.limit if now is not None and now.limit else (last.limit if last else None)
    rose = (
        now is not None
        and last is not None
        and now.oom_kills is not None
        and last.oom_kills is not None
        and now.oom_kills > last.oom_kills
    )
    peak = now.peak if now is not None else None
    if kernel is not None:
        if kernel.limited_by == "":  # the whole machine ran out
            ram = host.machine_ram()
            return OomVerdict(True, kernel.rss, ram, "")
        where = kernel.limited_by or kernel.memcg or cgroup
        return OomVerdict(True, kernel.rss, limit, where, peak)
    if kernel_log_read:
        return None
    if rose:
        assert now is not None and last is not None
        rss = max(v for v in (now.peak, last.rss) if v is not None)
        return OomVerdict(True, rss, limit, cgroup, peak)
    if last is not None and last.limit:
        reach = last.rss_at(died_at) if died_at is not None else last.rss
        if reach >= NEAR_LIMIT * last.limit:
            return OomVerdict(False, last.rss, last.limit, cgroup, growth=last.growth)
    return None


def explain(
    run_dir: str | None, rank: int, pid: int | None, died_at: float | None = None
) -> OomVerdict | None:
    """The verdict on rank ``rank`` (pid ``pid``), dead of SIGKILL at ``died_at`` (wall
    clock), or None (nothing says it was the out-of-memory killer)."""
    last = memory_file.read(run_dir, rank) if run_dir else None
    if pid is None and last is not None:
        pid = last.pid
    memcg, since = _where_and_since(last)
    read, kernel = host.kernel_kill(pid, memcg, since) if pid is not None else (False, None)
    return judge(last, kernel, _cgroup_now(last), read, died_at)


# torch's words for a DataLoader worker that died: its SIGCHLD handler's, its timeout's
_WORKER = re.compile(
    r"DataLoader worker \(pids?(?:\(s\))? ([\d, ]+)\) "
    r"(?:is killed by signal: Killed|exited unexpectedly)"
)


def worker_pids(message: str) -> list[int]:
    """The pids of the DataLoader workers whose death torch's ``message`` reports."""
    m = _WORKER.search(message)
    return [int(p) for p in re.findall(r"\d+", m.group(1))] if m else []


def explain_worker(run_dir: str | None, rank: int, message: str) -> str | None:
    """For a rank that raised because a DataLoader worker of its died: the sentence that says
    the out-of-memory killer killed that worker, with figures (None: nothing says so)."""
    pids = worker_pids(message)
    if not pids:
        return None
    last = memory_file.read(run_dir, rank) if run_dir else None
    now = _cgroup_now(last)
    for pid in pids:
        read, kernel = host.kernel_kill(pid, *_where_and_since(last))
        v = judge(last, kernel, now, read)
        if v is not None:
            return f"{v.text(f'Its DataLoader worker (pid {pid})')}. {what_to_do(v)}"
    return None


def _where_and_since(last: MemorySample | None) -> tuple[str | None, float | None]:
    """The rank's memory cgroup and since when a kill can be its own: from a little before
    its last sample (an older kill in a shared cgroup is another process's)."""
    if last is None:
        return None, None
    return last.cgroup, last.time - SAMPLE_SLACK_S


def _cgroup_now(last: MemorySample | None) -> host.CgroupMemory | None:
    if last is None or last.cgroup is None or last.cgroup_version is None:
        return None
    path = host.cgroup_path(last.cgroup_version, last.cgroup)
    return host.cgroup_memory(host.Cgroup(last.cgroup, last.cgroup_version, path))


def what_to_do(v: OomVerdict) -> str:
    """The advice that follows the verdict."""
    check = "" if v.certain else "The kernel log (`dmesg`) says for sure. "
    return (
        f"{check}Lower the memory the rank holds (the batch size, the DataLoader's workers "
        "and prefetch) or raise the limit."
    )


__all__ = [
    "NEAR_LIMIT",
    "OomVerdict",
    "explain",
    "explain_worker",
    "judge",
    "what_to_do",
    "worker_pids",
]
