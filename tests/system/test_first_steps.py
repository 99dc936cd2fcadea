"""What a new user does first: the README's plain
call, a failing script on the command line, its MLflow run's source, a first call in a kernel.
Small and real: gloo process groups, the ``gangrun`` command, a sqlite MLflow store, a kernel."""

from __future__ import annotations

import json
import os
import sys
import uuid

import pytest

from conftest import assert_no_survivors, run_bounded

pytestmark = pytest.mark.slow

# The README's body, plain-called twice and then distributed.
PLAIN_TWICE = """
import json, os
from gangrun import distributed

VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK",
        "MASTER_ADDR", "MASTER_PORT")

@distributed(processes=2, timeout=120)
def train(num_epochs: int, batch_size: int):
    import torch, torch.distributed as dist, gangrun
    dist.init_process_group(gangrun.backend())
    t = torch.ones(1) * (dist.get_rank() + 1)
    dist.all_reduce(t)
    # left initialised, as most training scripts do
    return [dist.get_rank(), dist.get_world_size(), t.item(), os.environ["MASTER_PORT"]]

before = {k: os.environ.get(k) for k in VARS}
first = train(1, 8)
between = {k: os.environ.get(k) for k in VARS}
second = train(1, 8)
import torch.distributed as dist
print(json.dumps({
    "first": first, "second": second, "before": before, "between": between,
    "after": {k: os.environ.get(k) for k in VARS}, "initialized": dist.is_initialized(),
    "distributed": train.distributed(1, 8),
}))
"""


def test_plain_call_is_a_world_of_one_twice(script):
    proc = script(PLAIN_TWICE)
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, err
    got = json.loads(out.strip().splitlines()[-1])
    assert got["first"][:3] == [0, 1, 1.0] and got["second"][:3] == [0, 1, 1.0]
    assert got["before"] == got["between"] == got["after"]  # restored after each call
    assert set(got["after"].values()) == {None}
    assert got["initialized"] is False  # the group the plain call left was destroyed
    assert [r[:3] for r in got["distributed"]] == [[0, 2, 3.0], [1, 2, 3.0]]
    assert_no_survivors(proc.pid)


def _gangrun(tmp_path, *args, env=None):
    cmd = [sys.executable, "-m", "gangrun", *args]
    proc = run_bounded(cmd, env={**(env or {}), "TMPDIR": str(tmp_path)}, cwd=tmp_path, timeout=120)
    return proc.returncode, proc.stdout, proc.stderr


SILENT_DEATH = """
import os, signal, time
if os.environ["RANK"] == "1":
    os.kill(os.getpid(), signal.SIGKILL)  # no output, no exception
time.sleep(30)
"""


def test_cli_failure_message_has_no_gap_and_names_kept_log_files(tmp_path):
    (tmp_path / "die.py").write_text(SILENT_DEATH)
    code, _, err = _gangrun(tmp_path, "run", "--processes", "2", "--no-mlflow", "die.py")
    assert code == 128 + 9, err
    assert "\n\n\n" not in err, err  # no gaps in the failure message
    assert "err.logs" not in err
    line = err.split("Full logs: ", 1)[1]
    path = line.split(" (rank 1)")[0]
    assert path.endswith("rank-1.log") and os.path.isfile(path), line
    assert os.path.isfile(os.path.join(os.path.dirname(path), "rank-0.log"))
    assert path.startswith(str(tmp_path / "gangrun-logs-"))


def _source_tags(tmp_path, script) -> dict[str, str]:
    mlflow = pytest.importorskip("mlflow")
    name = f"source-{uuid.uuid4().hex}"  # in the session's store (created once: conftest)
    code, out, err = _gangrun(
        tmp_path, "run", "--processes", "1", "--experiment-name", name, str(script)
    )
    assert code == 0, err
    client = mlflow.MlflowClient()
    runs = client.search_runs([client.get_experiment_by_name(name).experiment_id])
    assert len(runs) == 1
    return {k: v for k, v in runs[0].data.tags.items() if k.startswith("mlflow.source")}


@pytest.mark.mlflow
def test_cli_run_source_is_the_users_script_not_gangrun(tmp_path):
    # the commit of a script's own repository: tests/unit/test_first_steps_units.py
    pytest.importorskip("git")
    loose = tmp_path / "loose"  # in no git repository
    loose.mkdir()
    (loose / "train.py").write_text("print('hi')\n")
    tags = _source_tags(loose, loose / "train.py")
    assert tags["mlflow.source.name"] == str(loose / "train.py")
    assert "mlflow.source.git.commit" not in tags  # not gangrun's own checkout's


# A first call a few seconds after decorating pays for no caller-side import a call needs
# (the launcher, the output pump, the panel: 20 ms of 50): the background prewarm imports
# them; the figure is in bench/bench_notebook.py (docs/benchmarks.md).
FIRST_CALL = """\
import sys, time
from gangrun import distributed
from gangrun.notebook import warm

@distributed(processes=2, timeout=120)
def first():
    return 1

assert warm.wait(60)
before = set(sys.modules)
print("RESULT", first.distributed())
print("NEW", sorted(m for m in set(sys.modules) - before if m.split(".")[0] in ("gangrun", "cloudpickle", "psutil")))
"""


def test_first_call_after_prewarm_imports_nothing_in_the_kernel(tmp_path):
    pytest.importorskip("jupyter_client")
    pytest.importorskip("ipykernel")
    from kernelharness import Kernel, kernel_env

    k = Kernel(kernel_env(HOME=str(tmp_path), MPLBACKEND="agg"), str(tmp_path))
    try:
        a = k.execute(FIRST_CALL)
        assert k.error(a) is None, k.error(a)
        out = k.stream(a)
        assert "RESULT [1, 1]" in out, out
        assert "NEW []" in out, out
    finally:
        left = k.shutdown()
        assert not left, f"processes of the kernel survived its shutdown: {left}"
