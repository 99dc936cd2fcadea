"""The caller's side of a real two-raylet cluster: which node a failure
happened on, a Ray Client caller's death, and a caller the nodes cannot reach.

See :mod:`raycluster`: the head shares this process's filesystem view, the second raylet runs
in its own mount namespace with the ``hidden`` directory under an empty tmpfs. The Ray Client
caller runs in a mount namespace of its own too, with the cluster's whole temp directory (its
sessions, sockets and logs) hidden: it reaches the cluster only through ``ray://``.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("ray")

from gangrun import DistributedError, GangError, LaunchError, distributed  # noqa: E402

pytestmark = pytest.mark.slow

NODE = r"node [0-9.]+ \(Ray node id [0-9a-f]{16}\)"  # how errors name a node


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    root = tmp_path_factory.mktemp("hidden")
    (root / "project").mkdir()
    return root


@pytest.fixture(scope="module")
def cluster(base):
    from raycluster import running

    with running(str(base)) as c:
        yield c


@pytest.fixture
def project(base, monkeypatch):
    monkeypatch.chdir(base / "project")
    return base / "project"


def _gang(cluster, **kw):
    import gangrun

    return gangrun.Gang(
        processes=2,
        backend="ray",
        address=cluster.address,
        mlflow=False,
        env={"GANGRUN_RAY_STRATEGY": "STRICT_SPREAD"},
        **kw,
    )


def _wait_no_actors(cluster, wait: float = 30.0) -> list[int]:
    deadline = time.monotonic() + wait
    while cluster.actors() and time.monotonic() < deadline:
        time.sleep(0.2)
    return cluster.actors()


def _head_node() -> str:
    import ray

    return str(ray.get_runtime_context().get_node_id())  # this driver runs on the head


# ------------------------------------------------------------------ which node
def test_cell_error_on_another_node_names_the_node(cluster, project):
    """An exception in a cell on a rank of the other raylet says where, not only "failed on
    rank 1 (of 2)": the message, ``err.failures`` and the rank's `RankFailure.node` name the
    node (a rank on the caller's node has none)."""
    g = _gang(cluster)
    try:
        nodes = g.execute("import os\nos.environ['GANGRUN_RAY_NODE_ID']")
        here = nodes.index(_head_node())
        there = 1 - here
        with pytest.raises(GangError) as info:
            g.execute(f"if os.environ['RANK'] == '{there}':\n    raise ValueError('boom')")
        err = info.value
        text = str(err)
        assert re.search(f"failed on rank {there} \\(of 2\\) on {NODE}: ValueError: boom", text)
        node = err.failures[there].node
        assert node and re.fullmatch(NODE, node), node
        assert nodes[there][:16] in node  # the rank's own node
        assert f"[rank {there} on {node}]" in text
        # both ranks raise: each failure says where it ran, the caller's node nowhere
        with pytest.raises(GangError) as info:
            g.execute("raise KeyError(os.environ['RANK'])")
        f = info.value.failures
        assert f[here].node is None and f[there].node == node
        assert f"[rank {there} on {node}]" in str(info.value)
        assert f"[rank {here}]" in str(info.value)
        assert g.execute("1") == [1, 1]  # still usable
    finally:
        g.close()
    assert not _wait_no_actors(cluster), "rank actors survived the gang's close"


def raises_off(head: str) -> str:
    node = os.environ["GANGRUN_RAY_NODE_ID"]
    if node != head:
        raise ValueError("boom on the other node")
    return node


def test_distributed_error_on_another_node_that_sees_the_files_names_it(
    cluster, tmp_path, monkeypatch
):
    """``.distributed()``: a rank on another node that *does* see the caller's directory
    (here: a directory the second raylet does not hide, as on shared storage) is named too:
    its error says where it ran."""
    monkeypatch.chdir(tmp_path)
    fn = distributed(
        processes=2,
        backend="ray",
        address=cluster.address,
        mlflow=False,
        grace_period=1.0,
        env={"GANGRUN_RAY_STRATEGY": "STRICT_SPREAD"},
    )(raises_off)
    with pytest.raises(DistributedError) as info:
        fn.distributed(_head_node())
    err = info.value
    assert err.rank is not None
    node = err.failures[err.rank].node
    assert node and re.fullmatch(NODE, node), (node, str(err))
    assert re.search(f"Rank {err.rank} \\(pid \\d+\\) on {NODE} failed: ValueError", str(err))
    assert "does not see this machine's files" not in str(err)  # it does see them


# ---------------------------------------------------- a Ray Client caller dies
# Ray's client server starts a server process per client, and that start can crash (a gRPC
# segfault in the proxy's fork, "skipping fork() handlers": seen on 1 cluster in 4 here): the
# callers connect first, retrying, and the gang then uses that connection.
CONNECT = """
import sys, time
import ray

def connect(address):
    for attempt in range(3):
        try:
            return ray.init(address, log_to_driver=False, logging_level="WARNING")
        except ConnectionError as exc:
            print("connecting again:", exc, file=sys.stderr, flush=True)
            ray.shutdown()
            time.sleep(2)
    raise SystemExit("Ray Client could not connect")
"""

CLIENT_CALLER = (
    CONNECT
    + """
import os
import gangrun

address, hidden = sys.argv[1], sys.argv[2]
print("hidden", os.listdir(hidden), flush=True)  # the cluster's temp dir is not visible
connect(address)
g = gangrun.Gang(processes=2, backend="ray", address=address, mlflow=False,
                 env={"GANGRUN_RAY_STRATEGY": "STRICT_SPREAD"})
print("pids", g.execute("import os\\nos.getpid()"), flush=True)
import time
time.sleep(300)
"""
)


def test_ray_client_caller_killed_leaves_nothing_within_seconds(cluster, tmp_path):
    """A ``ray://`` caller (in its own mount namespace: it shares no file with the cluster)
    SIGKILLed: Ray Client's reconnect grace keeps its driver on the head ~31 s, but the
    actors end its ranks and themselves within a few seconds."""
    from conftest import run_processes

    path = tmp_path / "caller.py"
    path.write_text(CLIENT_CALLER)
    hide = 'mount -t tmpfs -o size=1m tmpfs "$0" && exec "$@"'
    cmd = ["unshare", "--mount", "--propagation", "private", "sh", "-c", hide, cluster.temp]
    caller = subprocess.Popen(
        [*cmd, sys.executable, str(path), cluster.client_address, cluster.temp],
        cwd=str(tmp_path),
        env=dict(os.environ, HOME=str(tmp_path)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert caller.stdout is not None
        assert caller.stdout.readline().strip() == "hidden []"
        line = caller.stdout.readline()  # bounded: the gang starts or the caller fails
        assert line.startswith("pids"), (line, caller.poll(), caller.stderr.read(2000))
        ranks = run_processes(caller.pid)
        assert len(ranks) >= 2 and len(cluster.actors()) == 2
    finally:
        caller.send_signal(signal.SIGKILL)
        caller.communicate(timeout=30)
    t0 = time.monotonic()
    deadline = t0 + 30
    while (cluster.actors() or run_processes(caller.pid)) and time.monotonic() < deadline:
        time.sleep(0.2)
    took = time.monotonic() - t0
    assert not cluster.actors() and not run_processes(caller.pid), "the caller's ranks survived"
    assert took < 10.0, f"the ranks and actors outlived their ray:// caller by {took:.1f}s"


def test_ray_client_caller_works_and_errors_name_the_node(cluster, tmp_path):
    """A ``ray://`` caller is on no node of the cluster: every rank is on another node, and
    its cell errors say which; its gang closes leaving no actor."""
    code = CONNECT + (
        "import os, gangrun\n"
        "connect(sys.argv[1])\n"
        "g = gangrun.Gang(processes=2, backend='ray', address=sys.argv[1], mlflow=False,\n"
        "                 env={'GANGRUN_RAY_STRATEGY': 'STRICT_SPREAD'})\n"
        "try:\n"
        "    g.execute('raise ValueError(1)')\n"
        "except gangrun.GangError as err:\n"
        "    print('NODES', [err.failures[r].node for r in (0, 1)], flush=True)\n"
        "g.close()\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, cluster.client_address],
        cwd=str(tmp_path),
        capture_output=True,
        text=True,
        timeout=240,
    )
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("NODES")), "")
    assert len(re.findall(NODE, line)) == 2, (out.stdout, out.stderr[-2000:])
    assert not _wait_no_actors(cluster)


# ----------------------------------------------- a caller the nodes cannot reach
def test_gang_whose_caller_the_nodes_cannot_reach_says_so(cluster, project, monkeypatch):
    """The ranks connect back to the caller; one they cannot reach (a laptop behind NAT)
    does not make ``Gang(...)`` wait out ``start_timeout``: each rank's connection is
    answered by the caller or given up within seconds, and ``Gang(...)`` says what to do."""
    monkeypatch.setenv("GANGRUN_GANG_HOST", "198.51.100.7")  # TEST-NET-2: not this machine
    t0 = time.monotonic()
    with pytest.raises(LaunchError) as info:
        _gang(cluster)
    took = time.monotonic() - t0
    text = str(info.value)
    assert "cannot reach this caller at tcp://198.51.100.7:" in text, text
    assert "GANGRUN_GANG_HOST" in text and "ray://" in text and "head node" in text
    assert took < 90, took  # not start_timeout (300 s)
    assert not _wait_no_actors(cluster), "rank actors survived the failed start"
    # an address the nodes reach, given explicitly: the gang works
    monkeypatch.setenv("GANGRUN_GANG_HOST", "127.0.0.1")
    g = _gang(cluster)
    try:
        assert g.execute("1") == [1, 1]
    finally:
        g.close()
