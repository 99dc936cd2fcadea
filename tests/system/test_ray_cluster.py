"""backend="ray" on a real two-raylet cluster whose second node does not see the caller's files.

See :mod:`raycluster`: the head shares this process's filesystem view, the second raylet runs
in its own mount namespace with the project's parent directory hidden under an empty tmpfs.
Environment synchronisation is what makes the project's modules and data files
reach the second node; the errors name the node and the fix when something did not travel.
"""

from __future__ import annotations

import os
import re
import time

import pytest

pytest.importorskip("ray")

from gangrun import (  # noqa: E402
    DistributedError,
    DistributedHangError,
    DistributedTimeoutError,
    LaunchError,
    distributed,
)

pytestmark = pytest.mark.slow

MYLIB = "VALUE = 42\n"
NODE = r"node [0-9.]+ \(Ray node id [0-9a-f]{16}\)"  # how errors name a node
EARLIER = "def twice(x):\n    return 2 * x\n"


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """The directory hidden on the second node: the project and an 'outside' directory."""
    root = tmp_path_factory.mktemp("hidden")
    proj = root / "project"
    (proj / "data").mkdir(parents=True)
    (proj / "mylib.py").write_text(MYLIB)
    (proj / "earlier_cell_mod.py").write_text(EARLIER)
    (proj / "data" / "x.txt").write_text("payload")
    (proj / ".gitignore").write_text("secret.txt\n")
    (proj / "secret.txt").write_text("ignored")
    (root / "outside").mkdir()
    (root / "outside" / "x.txt").write_text("far away")
    (root / "outside" / "outsidemod.py").write_text("VALUE = 1\n")
    return root


@pytest.fixture(scope="module")
def cluster(base):
    from raycluster import running

    with running(str(base)) as c:
        yield c


@pytest.fixture
def project(base, monkeypatch):
    """The caller works in the project, which is on its sys.path (as a notebook's directory
    is in a kernel)."""
    monkeypatch.chdir(base / "project")
    monkeypatch.syspath_prepend(str(base / "project"))
    return base / "project"


def _opts(cluster, **kw):
    env = {"GANGRUN_RAY_STRATEGY": "STRICT_SPREAD", **kw.pop("env", {})}
    return dict(processes=2, backend="ray", address=cluster.address, env=env, **kw)


def uses_project() -> dict:
    import mylib  # beside the caller, imported by name inside the function

    with open("data/x.txt") as f:  # a relative data file
        data = f.read()
    with open(f"written.{os.environ['RANK']}", "w") as f:  # a relative write
        f.write("x")
    return {
        "value": mylib.VALUE,
        "data": data,
        "node": os.environ["GANGRUN_RAY_NODE_ID"],
        "cwd": os.getcwd(),
    }


def _caller_node_rank(out: list[dict]) -> int:
    import ray

    head = ray.get_runtime_context().get_node_id()  # this driver runs on the head's node
    return [o["node"] for o in out].index(head)


def _earlier_cell_function():
    """A function as a notebook makes it: defined in ``__main__`` (pickled by value) and using
    a module imported in an earlier cell (pickled by reference)."""
    ns = {"__name__": "__main__"}
    exec("import earlier_cell_mod\ndef f(x):\n    return earlier_cell_mod.twice(x)\n", ns)
    return ns["f"]


def _sent(caplog) -> list[str]:
    """The packages the calls so far sent to the cluster (what `ship.upload` says it
    shipped, on gangrun's Ray logger)."""
    return [
        str(r.args[1])
        for r in caplog.records
        if r.name == "gangrun.launch.ray" and r.msg.startswith("shipped ") and r.args
    ]


def test_project_modules_and_data_reach_both_nodes(cluster, project, caplog):
    import logging

    caplog.set_level(logging.INFO, logger="gangrun.launch.ray")
    fn = distributed(**_opts(cluster))(uses_project)
    out = fn.distributed()
    assert out[0]["node"] != out[1]["node"]  # really on the two raylets
    assert [o["value"] for o in out] == [42, 42]
    assert [o["data"] for o in out] == ["payload", "payload"]
    # the rank on the caller's node runs in the caller's real directory; the other in the
    # shipped copy, where relative paths mean the same files
    here = _caller_node_rank(out)
    there = 1 - here
    assert out[here]["cwd"] == str(project)
    assert out[there]["cwd"] != str(project) and "_ray_pkg_" in out[there]["cwd"]
    assert (project / f"written.{here}").exists()
    assert not (project / f"written.{there}").exists()
    (project / f"written.{here}").unlink()  # the project is as it was before the call again
    first = _sent(caplog)
    assert len(first) == 2, first  # the project, and the directory of this test module

    f = _earlier_cell_function()
    assert distributed(**_opts(cluster))(f).distributed(21) == [42, 42]
    # an unchanged project is not uploaded again: the second call uploaded nothing
    assert _sent(caplog) == first
    assert len(set(first)) == len(first)


def reads_outside(path: str) -> str:
    with open(path) as f:
        return f.read()


def test_file_outside_what_ships_names_node_and_fix(cluster, project, base):
    fn = distributed(**_opts(cluster, grace_period=1.0))(reads_outside)
    outside = str(base / "outside" / "x.txt")
    with pytest.raises(DistributedError) as info:
        fn.distributed(outside)
    text = str(info.value)
    assert "FileNotFoundError" in text
    assert re.search(NODE, text), text
    assert f"{outside} exists on this machine" in text
    assert "RayOptions(paths=" in text  # the setting that ships it
    # a file the project's .gitignore excludes is said to be excluded
    with pytest.raises(DistributedError) as info:
        fn.distributed("secret.txt")
    assert "excluded (.gitignore" in str(info.value)


def imports_by_name() -> int:
    import outsidemod

    return int(outsidemod.VALUE)


def test_module_outside_what_ships_names_node_and_fix(cluster, project, base, monkeypatch):
    monkeypatch.syspath_prepend(str(base / "outside"))  # importable here, not shipped
    fn = distributed(**_opts(cluster, grace_period=1.0))(imports_by_name)
    with pytest.raises(DistributedError) as info:
        fn.distributed()
    text = str(info.value)
    assert "ModuleNotFoundError" in text
    assert re.search("module 'outsidemod' is not on " + NODE, text), text
    assert str(base / "outside" / "outsidemod.py") in text
    # shipping that directory makes it work on both nodes
    ok = distributed(**_opts(cluster, ray={"paths": [str(base / "outside")]}))(imports_by_name)
    assert ok.distributed() == [1, 1]


def marks_ran(flag: str) -> None:
    open(flag, "w").close()


def test_version_mismatch_is_reported_before_the_function_runs(
    cluster, project, tmp_path, monkeypatch
):
    from gangrun.launch.ray import versions

    mine = versions.local_versions()
    monkeypatch.setattr(versions, "local_versions", lambda: {**mine, "torch": "1.0.0"})
    flag = tmp_path / "ran"
    with pytest.raises(LaunchError) as info:
        distributed(**_opts(cluster))(marks_ran).distributed(str(flag))
    text = str(info.value)
    assert "the function was not started" in text
    assert re.search(f"torch {re.escape(mine['torch'])} on {NODE} vs 1.0.0 here", text), text
    assert not flag.exists()


def test_over_the_size_cap_names_the_biggest_entries(cluster, project):
    big = project / "weights.bin"
    big.write_bytes(os.urandom(300_000))
    try:
        fn = distributed(**_opts(cluster, ray={"max_ship_bytes": 200_000}))(marks_ran)
        with pytest.raises(LaunchError) as info:
            fn.distributed("x")
    finally:
        big.unlink()
    text = str(info.value)
    assert "over the limit of" in text and "weights.bin" in text
    assert "RayOptions(excludes=" in text and "ship=False" in text


# ---------------------------------------------------------------- gangs on the cluster
def gang_setup(flags: str) -> None:
    """What a notebook's setup does: the process group (and, in real use, a restore)."""
    import torch.distributed as dist

    import gangrun

    dist.init_process_group("gloo")
    state = gangrun.rank_state()
    state["ready"] = True
    attempt = len(os.listdir(flags))
    open(os.path.join(flags, f"setup.{os.environ['RANK']}.{attempt}"), "w").close()


def _gang(cluster, **kw):
    import gangrun

    return gangrun.Gang(
        processes=2,
        backend="ray",
        address=cluster.address,
        env={"GANGRUN_RAY_STRATEGY": "STRICT_SPREAD"},
        **kw,
    )


def _wait_no_actors(cluster, wait: float = 30.0) -> list[int]:

    deadline = time.monotonic() + wait
    while cluster.actors() and time.monotonic() < deadline:
        time.sleep(0.2)
    return cluster.actors()


def test_gang_across_raylets_keeps_state_and_heals(cluster, project, tmp_path, capfd):
    import functools
    import signal

    import ray

    flags = tmp_path / "flags"
    flags.mkdir()
    g = _gang(cluster, max_restarts=1, setup=functools.partial(gang_setup, str(flags)))
    try:
        nodes = g.execute(
            "import os, torch, torch.distributed as dist\nos.environ['GANGRUN_RAY_NODE_ID']"
        )
        assert nodes[0] != nodes[1]  # one rank on each raylet
        g.execute("x = int(os.environ['RANK']) + 1")
        assert g.execute("x") == [1, 2]  # state kept across executions
        assert g.execute("t = torch.tensor([float(x)]); dist.all_reduce(t); t.item()") == [3.0] * 2
        g.execute("print('hello from', os.environ['RANK'])")
        out = capfd.readouterr().out
        assert "[rank 0] hello from 0" in out and "[rank 1] hello from 1" in out
        assert g.run(len, "abc") == [3, 3]
        # an execution past its timeout is interrupted on both nodes (through the actors)...
        g.timeout = 1.0
        with pytest.raises(DistributedTimeoutError):
            g.execute("import time; time.sleep(60)")
        # ...and one that shows no progress prints every rank's stack into the cell
        g.timeout, g.hang_timeout = 60.0, 1.0
        with pytest.raises(DistributedHangError):
            g.execute("time.sleep(60)")
        assert "<gang-cell-" in "".join(capfd.readouterr())
        g.hang_timeout = None
        assert g.execute("x") == [1, 2]  # still usable, state kept

        remote = 1 - nodes.index(ray.get_runtime_context().get_node_id())
        os.kill(g.pids[remote], signal.SIGKILL)  # the rank on the second raylet dies
        try:
            g.execute("import time; time.sleep(0.5); 1")
        except DistributedError as err:  # the execution it interrupted is lost...
            assert "healed itself" in str(err), err
            assert re.search(NODE, str(err)), err  # a death without exception names its node
        # ...and the gang works again, with setup re-run on every fresh rank
        assert g.restarts == 1
        assert g.execute("ready") == [True, True]
        assert g.execute("'x' in dir()") == [False, False]  # fresh namespaces
        assert g.execute(
            "import torch, torch.distributed as dist\nt = torch.ones(1)\ndist.all_reduce(t)\nt.item()"
        ) == [2.0, 2.0]
        assert len(os.listdir(flags)) == 4  # setup ran on 2 ranks x 2 starts
        err_text = capfd.readouterr().err
        assert "restarting every rank of the gang (restart 1 of 1) and re-running setup()" in (
            err_text
        )
    finally:
        g.close()
    assert not _wait_no_actors(cluster), "rank actors survived the gang's close"


GANG_CALLER = """
import os, sys, time
import gangrun

address, flag = sys.argv[1], sys.argv[2]
g = gangrun.Gang(processes=2, backend="ray", address=address,
                 env={"GANGRUN_RAY_STRATEGY": "STRICT_SPREAD"})
g.execute("x = 1")
open(flag, "w").close()
time.sleep(300)
"""


def test_gang_caller_killed_leaves_nothing_on_either_raylet(cluster, project, tmp_path, script):
    import signal

    from conftest import assert_no_survivors, run_processes

    flag = tmp_path / "ready"
    caller = script(GANG_CALLER, cluster.address, str(flag))
    deadline = time.monotonic() + 120
    while not flag.exists() and time.monotonic() < deadline:
        assert caller.poll() is None, caller.communicate()
        time.sleep(0.2)
    assert flag.exists(), "the gang did not start"
    assert len(run_processes(caller.pid)) >= 2 and len(cluster.actors()) == 2
    caller.send_signal(signal.SIGKILL)  # the kernel dies
    caller.communicate(timeout=30)
    assert_no_survivors(caller.pid, wait=30)  # no rank process on either raylet
    assert not _wait_no_actors(cluster), "rank actors outlived their caller"


def test_notebook_cells_on_a_cluster_gang(cluster, project):
    """A real kernel in the project's folder: ``%%distributed`` cells on a gang with a rank on
    each raylet, the notebook's module importable on both, output in the cell, an interrupt
    that leaves the gang usable, and a kernel shutdown that leaves nothing anywhere."""
    from kernelharness import Kernel, kernel_env

    from conftest import assert_no_survivors

    k = Kernel(kernel_env(), str(project))
    try:
        mid = k.execute(
            "%load_ext gangrun\nimport gangrun\n"
            f"g = gangrun.Gang(processes=2, backend='ray', address={cluster.address!r}, "
            "env={'GANGRUN_RAY_STRATEGY': 'STRICT_SPREAD'})",
            timeout=180,
        )
        assert k.error(mid) is None, k.error(mid)
        mid = k.execute(
            "%%distributed g\nimport os, mylib\nprint('hi', os.environ['RANK'])\nmylib.VALUE"
        )
        assert k.error(mid) is None, k.error(mid)
        out = k.stream(mid)
        assert "[rank 0] hi 0" in out and "[rank 1] hi 1" in out, out
        result = [m["content"]["data"]["text/plain"] for m in k.of(mid, "execute_result")]
        assert result == ["[rank 0] 42\n[rank 1] 42"], result
        mid = k.execute("%%distributed g\nimport time\ntime.sleep(60)", wait=False)
        time.sleep(3.0)
        k.km.interrupt_kernel()
        k.wait_idle(mid, timeout=60)
        assert (k.error(mid) or {}).get("ename") == "KeyboardInterrupt", k.error(mid)
        mid = k.execute("%%distributed g\nos.environ['RANK']")
        result = [m["content"]["data"]["text/plain"] for m in k.of(mid, "execute_result")]
        assert result == ["[rank 0] '0'\n[rank 1] '1'"], (result, k.error(mid))
    finally:
        left = k.shutdown()
    assert not left, left
    assert_no_survivors(k.pid, wait=30)
    assert not _wait_no_actors(cluster), "rank actors outlived the kernel"
