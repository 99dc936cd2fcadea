"""Memory: the host's files parsed (cgroup v1 and v2, the kernel log), the rank's sample and its
file, the out-of-memory verdict's facts and words, a CUDA out-of-memory error's figures."""

from __future__ import annotations

import os

import pytest

from gangrun.host import memory as host
from gangrun.lifecycle import oom
from gangrun.rank import memory as rank_memory
from gangrun.wire import memory as memory_file
from gangrun.wire.memory import MemorySample, fmt_bytes

MiB, GiB = 1 << 20, 1 << 30

KMSG = [
    "python invoked oom-killer: gfp_mask=0xcc0(GFP_KERNEL), order=0, oom_score_adj=0",
    "oom-kill:constraint=CONSTRAINT_MEMCG,nodemask=(null),cpuset=/,mems_allowed=0,"
    "oom_memcg=/jobs/a,task_memcg=/jobs/a/rank1,task=python,pid=4242,uid=0",
    "Memory cgroup out of memory: Killed process 4242 (python) total-vm:1094372kB, "
    "anon-rss:300000kB, file-rss:20000kB, shmem-rss:4kB, UID:0 pgtables:1076kB oom_score_adj:0",
]


# ---------------------------------------------------------------- the host's files
def test_proc_cgroup_and_mountinfo_name_the_memory_hierarchies():
    v1 = "9:name=systemd:/\n4:memory:/process_api/abc\n3:cpuset:/\n0::/\n"
    assert host.parse_proc_cgroup(v1) == {1: "/process_api/abc", 2: "/"}
    assert host.parse_proc_cgroup("0::/user.slice/job\n") == {2: "/user.slice/job"}
    mountinfo = (
        "31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755\n"
        "32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu\n"
        "35 31 0:32 /ctr /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n"
        "41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n"
    )
    mounted = host.parse_mountinfo(mountinfo)
    assert mounted == {1: ("/ctr", "/sys/fs/cgroup/memory"), 2: ("/", "/sys/fs/cgroup/unified")}
    # a name under the mount's root is relative to it (a container's view)
    assert host.cgroup_path(1, "/ctr/job", mounted) == "/sys/fs/cgroup/memory/job"
    assert host.cgroup_path(2, "/a/b", mounted) == "/sys/fs/cgroup/unified/a/b"


def test_the_oom_kill_counters_of_v2_memory_events_and_v1_oom_control():
    events = "low 0\nhigh 3\nmax 17\noom 2\noom_kill 1\noom_group_kill 0\n"
    assert host.parse_memory_events(events) == 1
    assert host.parse_oom_control("oom_kill_disable 0\nunder_oom 0\noom_kill 4\n") == 4
    assert host.parse_oom_control("oom_kill_disable 0\nunder_oom 0\n") is None  # old kernel
    assert host.parse_memory_events("oom_kill x\n") is None


def test_a_cgroup_directory_gives_its_limit_peak_and_counter(tmp_path):
    parent = tmp_path / "job"
    (parent / "rank1").mkdir(parents=True)
    (parent / "memory.limit_in_bytes").write_text(f"{2 * GiB}\n")
    leaf = parent / "rank1"
    (leaf / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # none of its own
    (leaf / "memory.usage_in_bytes").write_text(f"{MiB}\n")
    (leaf / "memory.max_usage_in_bytes").write_text(f"{3 * MiB}\n")
    (leaf / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 2\n")
    got = host.cgroup_memory(host.Cgroup("/job/rank1", 1, str(leaf)))
    assert got == host.CgroupMemory(limit=2 * GiB, usage=MiB, peak=3 * MiB, oom_kills=2)
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "memory.max").write_text("max\n")
    (v2 / "memory.current").write_text("4096\n")
    (v2 / "memory.events").write_text("oom 1\noom_kill 1\n")
    got = host.cgroup_memory(host.Cgroup("/v2", 2, str(v2)))
    assert got == host.CgroupMemory(limit=None, usage=4096, peak=None, oom_kills=1)


def test_the_kernel_log_names_the_killed_pid_its_memory_and_cgroup():
    kill = host.parse_kernel_log(KMSG, 4242)
    assert kill == host.KernelKill(4242, (300000 + 20000 + 4) * 1024, "/jobs/a/rank1", "/jobs/a")
    assert host.parse_kernel_log(KMSG, 4243) is None
    # a pid of another namespace (a container's): the kill in the rank's cgroup
    assert host.parse_kernel_log(KMSG, 17, memcg="/jobs/a/rank1") == kill
    # the machine ran out (no memory cgroup limit): an older kernel's words, dmesg's prefix
    system = [
        "[  362.6] oom-kill:constraint=CONSTRAINT_NONE,nodemask=(null),cpuset=/,"
        "mems_allowed=0,global_oom,task_memcg=/,task=python,pid=77,uid=1000",
        "[  362.7] Out of memory: Killed process 77 (python) total-vm:9kB, anon-rss:2048kB, "
        "file-rss:0kB, shmem-rss:0kB",
    ]
    assert host.parse_kernel_log(system, 77) == host.KernelKill(77, 2 * MiB, "/", "")
    older = ["Out of memory: Killed process 77 (python) total-vm:9kB, anon-rss:1024kB"]
    assert host.parse_kernel_log(older, 77) == host.KernelKill(77, MiB, None, "")
    in_cgroup = ["Memory cgroup out of memory: Killed process 77 (python) anon-rss:1024kB"]
    assert host.parse_kernel_log(in_cgroup, 77) == host.KernelKill(77, MiB, None, None)


def test_this_process_has_a_resident_tree_and_the_machine_ram():
    rss = host.tree_rss(os.getpid())
    assert rss is not None and rss >= host.process_rss(os.getpid()) > MiB
    assert host.tree_rss(2**22 + 7) is None  # no such pid
    assert (host.machine_ram() or 0) > 100 * MiB
    log = host.read_kernel_log(10)
    assert log is None or len(log) <= 10


# ---------------------------------------------------------------- the sample and its file
def test_a_sample_round_trips_through_its_file_and_reads_an_older_one(tmp_path):
    s = MemorySample(1, 42, 1.5, 3 * GiB, 12 * GiB, "/a/b", 1, 0, 0, 2 * GiB, 5 * GiB // 2)
    fd = memory_file.open_for_writing(str(tmp_path), 1)
    memory_file.write(fd, s)
    os.close(fd)
    assert memory_file.read(str(tmp_path), 1) == s
    assert memory_file.read_all(str(tmp_path), 3) == {1: s}
    assert s.text() == "3 GiB of 12 GiB (25%) · cuda:0 2 GiB allocated, 2.5 GiB reserved"
    assert len(s.to_bytes()) == memory_file.SIZE
    long = MemorySample(0, 1, 1.0, MiB, cgroup="/x" * 2000)
    assert len(long.to_bytes()) == memory_file.SIZE
    assert MemorySample.from_json(long.to_bytes().strip()) == MemorySample(0, 1, 1.0, MiB)
    assert MemorySample.from_json('{"rank": 0, "pid": 1, "time": 2, "rss": 3, "new": 1}') == (
        MemorySample(0, 1, 2, 3)
    )
    assert MemorySample.from_json("[1]") is None
    assert MemorySample.from_json('{"rank": 0, "pid": 1, "time": 2, "rss": "3"}') is None
    assert memory_file.read(str(tmp_path), 0) is None


def test_the_rank_nearest_its_limit_and_byte_figures():
    a = MemorySample(0, 1, 0, 4 * GiB, 16 * GiB)
    b = MemorySample(1, 2, 0, 11 * GiB, 12 * GiB)
    assert memory_file.nearest_limit({0: a, 1: b}) == (1, b)
    assert memory_file.nearest_limit({0: MemorySample(0, 1, 0, 5)}) is None
    assert [fmt_bytes(n) for n in (17, 512 << 10, 300 * MiB, int(11.2 * GiB), 12 * GiB)] == [
        "17 B",
        "512 KiB",
        "300 MiB",
        "11.2 GiB",
        "12 GiB",
    ]


def test_the_rank_samples_its_own_memory_and_cgroup():
    first = rank_memory.sample(3)
    assert first.growth is None
    grown = MemorySample(**{**first.to_dict(), "rss": first.rss - 64 * MiB, "time": first.time - 1})
    assert rank_memory.sample(3, before=grown).growth > 0
    s = rank_memory.sample(3)
    assert s.rank == 3 and s.pid == os.getpid() and s.rss > MiB and s.limit
    assert s.cuda_allocated is None  # no CUDA initialized in this process
    cg = host.memory_cgroup()
    assert (s.cgroup, s.cgroup_version) == ((cg.name, cg.version) if cg else (None, None))


# ---------------------------------------------------------------- the verdict
def _sample(rss: int, limit: int | None = 300 * MiB, kills: int | None = 0) -> MemorySample:
    return MemorySample(1, 4242, 0.0, rss, limit, "/jobs/a/rank1", 1, kills)


def test_the_kernel_log_makes_the_verdict_certain_with_its_figures():
    kill = host.parse_kernel_log(KMSG, 4242)
    now = host.CgroupMemory(300 * MiB, 0, 300 * MiB, 1)
    v = oom.judge(_sample(100 * MiB), kill, now)
    assert v is not None and v.certain
    assert v.text("Rank 1 (pid 4242)") == (
        "Rank 1 (pid 4242) was killed by the out-of-memory killer: 313 MiB resident of a "
        "300 MiB limit (memory cgroup /jobs/a)"
    )
    assert oom.what_to_do(v).startswith("Lower the memory the rank holds")
    # no sample at all (the rank died before its first): the kernel log alone
    alone = oom.judge(None, kill, None)
    assert alone is not None and alone.certain and alone.limit is None
    assert "313 MiB resident (memory cgroup /jobs/a)" in alone.text("rank 1")


def test_the_cgroup_counter_alone_makes_it_certain_and_says_a_shared_peak():
    now = host.CgroupMemory(12 * GiB, 0, 12 * GiB, 3)
    v = oom.judge(_sample(int(11.2 * GiB), 12 * GiB, kills=2), None, now)
    assert v is not None and v.certain
    assert v.text("rank 1") == (
        "rank 1 was killed by the out-of-memory killer: 12 GiB resident of a 12 GiB limit "
        "(memory cgroup /jobs/a/rank1)"
    )
    # the rank's resident memory counts pages charged to another cgroup (forked from it)
    shared = oom.judge(_sample(466 * MiB, kills=0), None, host.CgroupMemory(300 * MiB, 0, 0, 1))
    assert shared is not None
    v = oom.OomVerdict(True, 466 * MiB, 300 * MiB, "/c", peak=300 * MiB)
    assert v.text("rank 1").endswith(
        "466 MiB resident of a 300 MiB limit (memory cgroup /c; 300 MiB charged to it at the peak)"
    )


def test_only_the_memory_trend_says_probably_and_nothing_says_none():
    near = oom.judge(_sample(290 * MiB), None, host.CgroupMemory(300 * MiB, 0, 0, 0))
    assert near is not None and not near.certain
    assert near.text("Rank 1 (pid 4242)") == (
        "Rank 1 (pid 4242) was killed by SIGKILL, probably by the out-of-memory killer: last "
        "sampled at 290 MiB resident of a 300 MiB limit (memory cgroup /jobs/a/rank1)"
    )
    assert "`dmesg`" in oom.what_to_do(near)
    # the trend: 200 MiB growing 100 MiB/s, dead a second later, had reached the limit
    growing = MemorySample(1, 4242, 10.0, 200 * MiB, 300 * MiB, "/c", 1, 0, growth=100 * MiB)
    assert oom.judge(growing, None, None) is None  # when it died unknown: 200 MiB is far
    v = oom.judge(growing, None, None, died_at=11.0)
    assert v is not None and not v.certain
    assert v.text("rank 1").endswith(
        "last sampled at 200 MiB resident of a 300 MiB limit, growing 100 MiB/s (memory cgroup /c)"
    )
    assert growing.rss_at(9.0) == growing.rss and growing.rss_at(10.5) == 250 * MiB
    # the kernel log was read and records no kill of it: another process's kill in a shared
    # cgroup raised the counter, and near its limit is not enough either
    rose = host.CgroupMemory(300 * MiB, 0, 0, 1)
    assert oom.judge(_sample(290 * MiB), None, rose, kernel_log_read=True) is None
    assert oom.judge(_sample(290 * MiB), None, rose).certain  # the log closed: the counter
    # far from its limit and no counter rose: a kill -9, not the out-of-memory killer
    assert oom.judge(_sample(20 * MiB), None, host.CgroupMemory(300 * MiB, 0, 0, 0)) is None
    assert oom.judge(None, None, None) is None
    # the machine ran out: its RAM is the limit
    system = host.KernelKill(77, 2 * GiB, "/", "")
    v = oom.judge(None, system, None)
    assert v is not None and v.certain and v.limit == host.machine_ram()
    assert v.text("rank 0").endswith("limit (the machine's memory)")


def test_a_dead_rank_without_a_sample_or_a_cgroup_gets_no_verdict(tmp_path):
    assert oom.explain(str(tmp_path), 0, 2**22 + 7) is None
    assert oom.explain(None, 0, None) is None
    assert oom.explain_worker(str(tmp_path), 0, "ValueError: DataLoader worker") is None


def test_torchs_words_for_a_dead_dataloader_worker_give_its_pids():
    killed = "DataLoader worker (pid 4242) is killed by signal: Killed. "
    assert oom.worker_pids(killed) == [4242]
    gone = "RuntimeError: DataLoader worker (pid(s) 4242, 4243) exited unexpectedly"
    assert oom.worker_pids(gone) == [4242, 4243]
    assert oom.worker_pids("DataLoader worker (pid 7) is killed by signal: Bus error.") == []


# ---------------------------------------------------------------- CUDA out of memory
def test_a_cuda_out_of_memory_error_names_the_device_and_its_figures():
    text = rank_memory.format_cuda_oom(1, int(10.2 * GiB), 11 * GiB, int(15.8 * GiB))
    assert text == (
        "On cuda:1, PyTorch had 10.2 GiB allocated and 11 GiB reserved (of 15.8 GiB on the "
        "device) when this rank ran out of GPU memory: lower the batch size, free tensors no "
        "longer needed, or see torch.cuda.memory_summary()."
    )
    assert "(of" not in rank_memory.format_cuda_oom(0, 1, 2)
    # another exception, or no CUDA here: nothing is added
    assert rank_memory.cuda_oom_note(ValueError("x")) is None

    class OutOfMemoryError(RuntimeError):
        pass

    assert rank_memory.cuda_oom_note(OutOfMemoryError("CUDA out of memory. GPU 0")) is None


class _FakeCuda:
    """A GPU's figures (the GPU is the one thing a stand-in may replace here)."""

    def is_initialized(self):
        return True

    def device_count(self):
        return 2

    def current_device(self):
        return 0  # a thread's own current device: not the rank's

    def memory_allocated(self, dev):
        return (dev + 1) * GiB

    def memory_reserved(self, dev):
        return (dev + 2) * GiB

    def get_device_properties(self, dev):
        import types

        return types.SimpleNamespace(total_memory=80 * GiB)


def test_the_sample_and_a_cuda_oom_read_the_ranks_device(monkeypatch):
    import sys
    import types

    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=_FakeCuda()))
    monkeypatch.setenv("LOCAL_RANK", "1")
    s = rank_memory.sample(1)
    assert (s.cuda_device, s.cuda_allocated, s.cuda_reserved) == (1, 2 * GiB, 3 * GiB)

    class OutOfMemoryError(RuntimeError):
        pass

    exc = OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB. GPU 1 has a total ...")
    assert rank_memory.cuda_oom_note(exc) == rank_memory.format_cuda_oom(
        1, 2 * GiB, 3 * GiB, 80 * GiB
    )
    # torch imported but CUDA never used: no figures, and CUDA is not initialized by asking
    monkeypatch.setattr(_FakeCuda, "is_initialized", lambda self: False)
    assert rank_memory.sample(1).cuda_allocated is None
    assert rank_memory.cuda_oom_note(exc) is None


@pytest.mark.parametrize("n", [0, 1])
def test_the_error_record_of_a_cuda_oom_carries_the_figures(monkeypatch, n):
    """The rank's error path appends the note (the device's figures: a GPU is a stand-in)."""
    from gangrun.rank import worker

    note = "On cuda:0, PyTorch had 1 GiB allocated and 2 GiB reserved"
    monkeypatch.setattr(rank_memory, "cuda_oom_note", lambda exc: note if n else None)
    rec = worker.error_record(0, RuntimeError("CUDA out of memory."), "tb")
    assert rec.message == ("CUDA out of memory.\n" + note if n else "CUDA out of memory.")


# ---------------------------------------------------------------- where it is shown
def _write_samples(run_dir: str, samples: list[MemorySample]) -> None:
    for s in samples:
        fd = memory_file.open_for_writing(run_dir, s.rank)
        memory_file.write(fd, s)
        os.close(fd)


def test_the_panel_rows_show_each_ranks_memory_and_the_nearest_limit():
    import types

    from gangrun.notebook import html
    from gangrun.notebook.state import CallState
    from gangrun.progress_view import Progress

    call = types.SimpleNamespace(fn_name="train", run_id="r1", world_size=3, max_restarts=0)
    st = CallState(call)
    st.starting()
    st.attempt_started(0)
    far = MemorySample(0, 10, 0.0, int(1.2 * GiB), 12 * GiB)
    near = MemorySample(
        1,
        11,
        0.0,
        int(11.2 * GiB),
        12 * GiB,
        cuda_device=0,
        cuda_allocated=3 * GiB,
        cuda_reserved=4 * GiB,
    )
    out = html.render_panel(st.snapshot, progress=Progress(memory={0: far, 1: near}))
    assert "<th " in out and ">memory</th>" in out
    row0 = out[out.index('data-rank="0"') : out.index('data-rank="1"')]
    row1 = out[out.index('data-rank="1"') : out.index('data-rank="2"')]
    row2 = out[out.index('data-rank="2"') :]
    assert f'data-rss="{far.rss}" data-limit="{12 * GiB}"' in row0
    assert "1.2 GiB of 12 GiB (10%)" in row0 and "data-nearest-limit" not in row0
    assert "data-nearest-limit" in row1 and "color:#d62728" in row1
    assert "11.2 GiB of 12 GiB (93%) · cuda:0 3 GiB allocated, 4 GiB reserved" in row1
    assert "data-rss" not in row2.split("</tr>")[0]  # no sample yet: an empty cell
    # the nearest rank far from its limit is not marked
    calm = html.render_panel(st.snapshot, progress=Progress(memory={0: far}))
    assert "data-nearest-limit" not in calm
    # the progress line (the panel's header, `gangrun run`'s status line) says it too
    from gangrun.progress_view import summary_line

    assert summary_line(Progress(step=3, memory={0: far, 1: near})) == (
        "step 3 · memory: rank 1 at 93% of its limit"
    )
    assert summary_line(Progress(step=3, memory={0: far})) == "step 3"


def test_the_watch_reads_the_ranks_samples_into_the_progress(tmp_path):
    import types

    from gangrun.lifecycle import watch

    s = MemorySample(1, 11, 0.0, 5 * MiB, 300 * MiB)
    _write_samples(str(tmp_path), [s])
    call = types.SimpleNamespace(world_size=2)
    run = types.SimpleNamespace(call=call, run_dir=str(tmp_path), log_dir="", gang=None)
    assert watch.Watch(run).progress().memory == {1: s}


def test_gangrun_ps_lists_each_ranks_memory(tmp_path, monkeypatch, capsys):
    import json
    import tempfile
    import time

    from gangrun.cli import entry as cli
    from gangrun.host.system import process_identity
    from gangrun.wire.rundir import CALL_RECORD

    d = tmp_path / "gangrun-mem001-x"
    d.mkdir(mode=0o700)
    rec = {
        "run_id": "mem001",
        "caller_pid": os.getpid(),
        "caller": process_identity(os.getpid()),
        "state": "running",
        "world_size": 2,
        "started": time.time(),
        "function": "train",
    }
    (d / CALL_RECORD).write_text(json.dumps(rec))
    now = time.time()
    _write_samples(
        str(d),
        [
            MemorySample(0, 10, now, int(1.2 * GiB), 12 * GiB),
            MemorySample(1, 11, now - 60, int(11.2 * GiB), 12 * GiB),  # its rank busy in C code
        ],
    )
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert cli.main(["ps"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    i = next(n for n, line in enumerate(lines) if line.startswith("  memory:"))
    assert lines[i] == "  memory: rank 0  1.2 GiB of 12 GiB (10%)"
    assert (
        lines[i + 1]
        == "          rank 1  11.2 GiB of 12 GiB (93%) (1m00s ago)  <- nearest its limit"
    )
    assert cli.main(["ps", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert listed[0]["memory"]["1"]["rss"] == int(11.2 * GiB)
    assert listed[0]["memory"]["0"]["limit"] == 12 * GiB


def test_the_system_metrics_monitor_logs_each_ranks_memory(tmp_path):
    from gangrun.tracking.memory import RankMemoryMonitor

    mon = RankMemoryMonitor(str(tmp_path), 2)
    mon.collect_metrics()
    assert mon.aggregate_metrics() == {}  # no sample yet
    _write_samples(
        str(tmp_path),
        [
            MemorySample(0, 10, 0.0, 100_000_000, 400_000_000),
            MemorySample(
                1,
                11,
                0.0,
                300_000_000,
                None,
                cuda_device=0,
                cuda_allocated=2_000_000_000,
                cuda_reserved=3_000_000_000,
            ),
        ],
    )
    mon.collect_metrics()
    _write_samples(str(tmp_path), [MemorySample(0, 10, 1.0, 200_000_000, 400_000_000)])
    mon.collect_metrics()
    assert mon.aggregate_metrics() == {
        "rank_0_memory_rss_megabytes": 150.0,
        "rank_0_memory_limit_percentage": 37.5,
        "rank_1_memory_rss_megabytes": 300.0,
        "rank_1_cuda_allocated_megabytes": 2000.0,
        "rank_1_cuda_reserved_megabytes": 3000.0,
    }
    assert set(mon.metrics) == set(mon.aggregate_metrics())
    mon.clear_metrics()
    assert mon.aggregate_metrics() == {}
