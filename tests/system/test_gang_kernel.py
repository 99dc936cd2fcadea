"""``%load_ext gangrun`` and ``%%distributed`` cells in a real IPython kernel (jupyter_client)."""

from __future__ import annotations

import queue
import time

import pytest

from conftest import assert_no_survivors, run_processes

jupyter_client = pytest.importorskip("jupyter_client")
pytest.importorskip("ipykernel")

pytestmark = pytest.mark.slow


class Kernel:
    def __init__(self, cwd) -> None:
        from jupyter_client.manager import KernelManager

        self.km = KernelManager(kernel_name="python3")
        self.km.start_kernel(cwd=str(cwd))
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=60)
        self.pid = int(self.km.provisioner.process.pid)

    def run(self, code: str, timeout: float = 90.0, interrupt_after: float | None = None) -> dict:
        """Execute a cell; its stream text, displayed result and error, bounded in time."""
        msg_id = self.kc.execute(code)
        out = {"stdout": "", "stderr": "", "result": None, "error": None}
        deadline = time.monotonic() + timeout
        t0 = time.monotonic()
        interrupted = interrupt_after is None
        while True:
            left = deadline - time.monotonic()
            assert left > 0, f"cell did not finish in {timeout}s: {code!r} {out}"
            if not interrupted and time.monotonic() - t0 > interrupt_after:
                self.km.interrupt_kernel()
                interrupted = True
                out["interrupted_at"] = time.monotonic()
            try:
                msg = self.kc.get_iopub_msg(timeout=min(left, 0.2))
            except queue.Empty:
                continue
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                out[content["name"]] += content["text"]
            elif kind == "execute_result":
                out["result"] = content["data"].get("text/plain")
            elif kind == "error":
                out["error"] = f"{content['ename']}: {content['evalue']}"
            elif kind == "status" and content["execution_state"] == "idle":
                out["done_at"] = time.monotonic()
                return out

    def shutdown(self) -> None:
        try:
            self.kc.stop_channels()
        finally:
            self.km.shutdown_kernel(now=False)


def test_distributed_cells_keep_state_and_shutdown_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    k = Kernel(tmp_path)
    try:
        r = k.run("%load_ext gangrun\nimport gangrun\ng = gangrun.Gang(processes=2)")
        assert r["error"] is None, r
        r = k.run(
            "%%distributed g\nimport os\nrank = int(os.environ['RANK'])\n"
            "print('hello from', rank)\nrank * 10"
        )
        assert r["error"] is None, r
        assert "[rank 0] hello from 0" in r["stdout"] and "[rank 1] hello from 1" in r["stdout"]
        assert r["result"] == "[rank 0] 0\n[rank 1] 10", r
        r = k.run("%%distributed\nrank + 1")  # the gang created last; state kept
        assert r["result"] == "[rank 0] 1\n[rank 1] 2", r
        r = k.run("print('after')")
        assert r["stdout"] == "after\n", r  # nothing of the ranks leaks into the next cell
        r = k.run("%%distributed g\n1 / rank")
        assert r["error"] and "ZeroDivisionError" in r["error"] and "rank 0" in r["error"], r
        r = k.run("%%distributed g\nimport time\ntime.sleep(60)", interrupt_after=1.5)
        assert r["error"] and r["error"].startswith("KeyboardInterrupt"), r
        assert r["done_at"] - r["interrupted_at"] < 3.0
        r = k.run("%%distributed g\nrank")
        assert r["result"] == "[rank 0] 0\n[rank 1] 1", r
        assert len(run_processes(k.pid)) >= 2
    finally:
        k.shutdown()
    assert_no_survivors(k.pid)
