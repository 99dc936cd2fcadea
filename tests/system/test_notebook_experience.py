"""The notebook experience, in real kernels driven through jupyter_client (every iopub message is kept with
the request it answers): output in the launching cell, the live panel, the cell's source in
rank tracebacks, mistakes caught before launch."""

from __future__ import annotations

import re

import pytest

from conftest import run_processes

pytest.importorskip("jupyter_client")
pytest.importorskip("ipykernel")
mlflow = pytest.importorskip("mlflow")

from kernelharness import Kernel, open_kernel  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture
def kernel(tmp_path):
    setup = "import time\nfrom gangrun import distributed"
    with open_kernel(tmp_path, str(tmp_path), setup, MPLBACKEND="agg") as k:
        yield k


def _panel_msgs(k: Kernel, msg_id: str) -> list[dict]:
    return [
        m
        for m in k.of(msg_id, "display_data", "update_display_data")
        if "gangrun-panel" in m["content"]["data"].get("text/html", "")
    ]


SUBMIT = """\
@distributed(processes=2, timeout=120)
def ticker(n: int):
    import time
    for i in range(n):
        print(f"tick {i}", flush=True)
        time.sleep(0.3)
    return n
h = ticker.submit(10)
"""


def test_submitted_call_output_stays_in_the_launching_cell(kernel):
    k = kernel
    a = k.execute(SUBMIT)
    others = [k.execute("time.sleep(0.8); print('other cell')") for _ in range(3)]
    c = k.execute("print(h.result(timeout=60))")
    k.pump(0.5)
    rank_msgs = [
        m for m in k.msgs if m["msg_type"] == "stream" and "[rank " in m["content"]["text"]
    ]
    assert rank_msgs, "no rank output at all"
    assert {m["parent_header"]["msg_id"] for m in rank_msgs} == {a}
    text = k.stream(a)
    for rank in (0, 1):
        for i in range(10):
            assert f"[rank {rank}] tick {i}\n" in text, text
    for o in others:
        assert k.stream(o) == "other cell\n"
    assert k.stream(c) == "[10, 10]\n"
    # some lines arrived after the launching cell had finished: they still went to it
    idle_at = next(
        i
        for i, m in enumerate(k.msgs)
        if m["msg_type"] == "status"
        and m["parent_header"].get("msg_id") == a
        and m["content"]["execution_state"] == "idle"
    )
    assert any(k.msgs.index(m) > idle_at for m in rank_msgs)
    # the panel of the call is in the launching cell too
    panel = _panel_msgs(k, a)
    assert panel and 'data-final="FINISHED"' in panel[-1]["content"]["data"]["text/html"]
    assert run_processes(k.pid) == []


PANEL = """\
@distributed(processes=2, timeout=120)
def train(steps: int):
    import os, time, mlflow
    rank = int(os.environ["RANK"])
    for step in range(steps):
        mlflow.log_metric(f"loss_rank{rank}", 1.0 / (step + 1 + rank), step=step)
        print(f"step {step}", flush=True)
        time.sleep(0.35)
    return rank
losses = train.distributed(12)
"""


@pytest.mark.mlflow
def test_panel_updates_in_place_names_every_rank_ends_final_with_chart(kernel):
    k = kernel
    a = k.execute(PANEL)
    assert k.error(a) is None, k.error(a)
    panel = _panel_msgs(k, a)
    first, updates = panel[0], panel[1:]
    assert first["msg_type"] == "display_data"
    display_id = first["content"]["transient"]["display_id"]
    html0 = first["content"]["data"]["text/html"]
    assert "starting 2 ranks" in html0
    assert len(updates) >= 3 and all(m["msg_type"] == "update_display_data" for m in updates)
    assert {m["content"]["transient"]["display_id"] for m in updates} == {display_id}
    final = updates[-1]["content"]["data"]["text/html"]
    assert 'data-final="FINISHED"' in final
    for rank in (0, 1):
        assert f'data-rank="{rank}" data-state="finished"' in final
    assert "step 11" in final  # the last line of each rank
    assert "<svg" in final and "loss_rank0" in final and "loss_rank1" in final
    assert re.search(r"MLflow run <code>[0-9a-f]{32}</code>", final)
    # a chart was drawn live too, not only at the end
    assert any("<svg" in m["content"]["data"]["text/html"] for m in updates[:-1])


def test_panel_off_with_progress_false_or_output_none(kernel):
    k = kernel
    a = k.execute(
        "@distributed(processes=2, progress=False)\n"
        "def q():\n    return 1\n"
        "q.distributed()\nq.options(progress=True, output='none').distributed()"
    )
    assert k.error(a) is None
    assert _panel_msgs(k, a) == []


FAILING = """\
@distributed(processes=2, timeout=120)
def broken(x: int):
    import os
    if os.environ["RANK"] == "1":
        value = x * 2
        raise ValueError("bad value " + str(value))  # the line the traceback must show
    import time
    time.sleep(30)
broken.distributed(21)
"""


def test_failing_notebook_function_traceback_shows_its_source_line(kernel):
    k = kernel
    a = k.execute(FAILING)
    err = k.error(a)
    assert err is not None and err["ename"] == "DistributedError", err
    tb = "\n".join(err["traceback"])
    assert 'raise ValueError("bad value " + str(value))' in tb, tb
    assert "Rank 1" in tb and "bad value 42" in tb
    panel = _panel_msgs(k, a)
    final = panel[-1]["content"]["data"]["text/html"]
    assert 'data-final="FAILED"' in final and 'data-rank="1" data-state="failed"' in final
    assert 'data-rank="0" data-state="stopped"' in final


def test_misspelled_argument_fails_fast_with_no_rank_started(kernel):
    k = kernel
    k.execute("@distributed(processes=2)\ndef fit(epochs: int):\n    return epochs")
    a = k.execute(
        "t0 = time.perf_counter()\ntry:\n    fit.distributed(epoch=3)\n"
        "finally:\n    print('took', time.perf_counter() - t0)"
    )
    err = k.error(a)
    assert err is not None and err["ename"] == "LaunchArgumentError", err
    assert "'epoch'" in err["evalue"] and "Did you mean 'epochs'?" in err["evalue"]
    took = float(k.stream(a).split("took", 1)[1])
    assert took < 1.0
    assert _panel_msgs(k, a) == []
    assert run_processes(k.pid) == []
    b = k.execute("isinstance(_exc := __import__('sys').last_value, TypeError)")
    assert k.of(b, "execute_result")[0]["content"]["data"]["text/plain"] == "True"


def test_misspelled_option_lists_valid_names(kernel):
    a = kernel.execute("distributed(num_gpus=2)")
    err = kernel.error(a)
    assert err is not None and "num_gpus" in err["evalue"]
    assert "did you mean 'gpus'?" in err["evalue"] and "processes" in err["evalue"]


NESTED = """\
@distributed(processes=2)
def inner():
    open(MARK, "w").close()

@distributed(processes=2, timeout=120)
def outer():
    inner.distributed()

t0 = time.perf_counter()
try:
    outer.distributed()
finally:
    print("took", time.perf_counter() - t0)
"""


def test_nested_call_fails_fast_in_the_rank_with_no_inner_rank(kernel, tmp_path):
    k = kernel
    mark = tmp_path / "inner-ran"
    a = k.execute(f"MARK = {str(mark)!r}\n" + NESTED)
    err = k.error(a)
    assert err is not None and err["ename"] == "DistributedError", err
    tb = "\n".join(err["traceback"])
    assert "nested calls are not supported" in tb and "already inside rank" in tb
    assert re.search(r"Rank [01] \(pid \d+\) failed: gangrun.errors.LaunchError", tb), tb
    assert float(k.stream(a).split("took", 1)[1]) < 30
    assert not mark.exists()


RESUMED = """\
@distributed(processes=2, timeout=120, max_restarts=3, restart_backoff=0.1)
def resumed():
    import os, signal, time
    from gangrun import report_step
    from gangrun.rank import progress
    if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
        report_step(5)
        time.sleep(0.5)
        if os.environ["RANK"] == "1":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(30)
    progress.report_resumed(5)  # what the checkpoint manager reports after a restore
    time.sleep(2.5)  # the panel reads the step reports about once a second
    return 1
resumed.distributed()
"""


def test_panel_shows_the_attempt_and_the_step_it_resumed_from(kernel):
    k = kernel
    a = k.execute(RESUMED)
    assert k.error(a) is None, k.error(a)
    htmls = [m["content"]["data"]["text/html"] for m in _panel_msgs(k, a)]
    assert any("attempt 1/4" in h and "resumed from" not in h for h in htmls)
    assert "attempt 2/4, resumed from step 5" in htmls[-1]
    assert 'data-final="FINISHED"' in htmls[-1]
    assert run_processes(k.pid) == []
