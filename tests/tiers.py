"""The test tiers: what each test module needs, and the smoke tests. The one place the tiers
are decided; `conftest.pytest_collection_modifyitems` marks the tests from it, and
tests/unit/test_tiers.py checks it (every module classified, what it says true).

    make test-smoke   the dozen tests below that prove the main paths (about a minute)
    make test-unit    tests/unit: no gangs, a few fresh interpreters
    make test-fast    everything that needs none of FAST_LEAVES_OUT (gangs of real processes)
    make test         the whole suite

A need is a marker (registered in pyproject.toml): ``pytest -m ray`` runs the tests that need
Ray, ``-m "not kernel"`` the others. When ``-m`` rules a whole module out, the module is not
even imported (`conftest.pytest_ignore_collect`): ``-m smoke`` imports only the smoke modules.
"""

from __future__ import annotations

import ast
import itertools
import re
from pathlib import Path

TESTS = Path(__file__).resolve().parent

# What a test needs beyond Python, gangrun's dependencies and the processes of its calls.
NEEDS_KINDS = {
    "ray": "a local Ray cluster (ray.cluster_utils, a raylet per node)",
    "kernel": "a real Jupyter kernel (jupyter_client, nbclient)",
    "browser": "a headless Chromium",
    "packaging": "a wheel build into a fresh venv, the docs build",
    "soak": "a randomized soak (tests/soak)",
}
# What `make test-fast` leaves out: all of them.
FAST_LEAVES_OUT = tuple(NEEDS_KINDS)
FAST_EXPR = "not (" + " or ".join(FAST_LEAVES_OUT) + ")"

# Every test module outside tests/unit, with what it needs (() for processes alone); a module
# under tests/unit needs nothing unless listed. A "module::test" key adds needs to one test.
NEEDS: dict[str, tuple[str, ...]] = {
    "reliability/test_call_lifecycle.py": (),
    "reliability/test_concurrency.py": (),
    "reliability/test_disk_and_forkserver.py": (),
    "reliability/test_hang_verdict.py": (),
    "reliability/test_launch_items.py": (),
    "reliability/test_one_writer.py": (),
    "reliability/test_oom.py": (),
    "reliability/test_refused_resume.py": (),
    "reliability/test_restart_and_hang.py": (),
    "reliability/test_restart_rules.py": (),
    "reliability/test_security.py": (),
    "reliability/test_tracking_outages.py": (),
    "soak/test_resume_exactness.py": ("soak",),
    "soak/test_soak.py": ("soak",),
    "system/test_checkpointer_contract.py": (),
    "system/test_cli.py": (),
    "system/test_core.py": (),
    "system/test_damaged_checkpoints.py": (),
    "system/test_data_checkpoint.py": (),
    "system/test_dataloader_resume.py": (),
    "system/test_elastic.py": (),
    "system/test_elastic_data.py": (),
    "system/test_quiet_output.py": (),
    "system/test_first_steps.py": (),
    "system/test_memory_view.py": (),
    "system/test_first_steps.py::test_first_call_after_prewarm_imports_nothing_in_the_kernel": (
        "kernel",
    ),
    "system/test_forkserver.py": (),
    "system/test_frameworks.py": (),
    "system/test_futures.py": (),
    "system/test_gang.py": (),
    "system/test_gang_heal.py": (),
    "system/test_gang_kernel.py": ("kernel",),
    "system/test_gang_notebook.py": ("kernel",),
    "system/test_loader_resume_order.py": (),
    "system/test_long_runs.py": (),
    "system/test_memory_snapshots.py": (),
    "system/test_notebook.py": ("kernel",),
    "system/test_notebook_browser.py": ("kernel", "browser"),
    "system/test_notebook_experience.py": ("kernel",),
    "system/test_notebook_watch.py": ("kernel",),
    "system/test_packaging.py": ("packaging",),
    "system/test_ray.py": ("ray",),
    "system/test_ray_caller.py": ("ray",),
    "system/test_ray_elastic.py": ("ray",),
    "system/test_ray_cluster.py": ("ray", "kernel"),
    "system/test_tables.py": (),
    "system/test_torch_distributor.py": (),
    "system/test_tracking.py": (),
    "system/test_tracking_options.py": (),
    "system/test_watch.py": (),
    "unit/test_demo_install.py::test_make_demo_installs_the_demo_set_and_make_test_the_dev_set": (
        "packaging",
    ),
}

# The main paths, one test each (make test-smoke): a call, a failure, a timeout, a cancel, the
# Future protocol, `import gangrun` staying light, `gangrun run`, a Checkpointer's save and
# exact resume, a cell in a real kernel, a Ray call across two raylets, the interactive gang;
# and the check of these tiers. Their time: docs/benchmarks.md.
SMOKE = (
    "system/test_core.py::test_success_results_env_and_output",
    "system/test_core.py::test_rank_raises_while_other_blocks_in_all_reduce",
    "system/test_core.py::test_timeout",
    "system/test_core.py::test_cancel",
    "system/test_futures.py::test_wait_as_completed_results_errors_and_callbacks",
    "system/test_cli.py::test_run_script_success",
    "system/test_core.py::test_import_is_lazy",
    "system/test_checkpointer_contract.py::test_plain_values_are_saved_as_they_are_at_save_time",
    "system/test_notebook_experience.py::test_submitted_call_output_stays_in_the_launching_cell",
    "system/test_ray.py::test_ddp_on_two_nodes",
    "system/test_gang.py::test_state_and_all_reduce_across_executions",
    "unit/test_tiers.py::test_every_test_module_is_classified",
)


def module_of(test_id: str) -> str:
    return test_id.split("::", 1)[0]


def needs(module: str, test: str | None = None) -> set[str]:
    """What ``module`` (relative to tests/), or its ``test`` (the name, parameters included or
    not), needs."""
    got = set(NEEDS.get(module, ()))
    if test is not None:
        got.update(NEEDS.get(f"{module}::{test}", ()))
        got.update(NEEDS.get(f"{module}::{test.split('[', 1)[0]}", ()))
    return got


def xdist_scope(module: str, nodeid: str) -> str:
    """What `make test`'s workers (pytest-xdist, ``-n 2 --dist loadgroup``; conftest's
    scheduler) run one after another on one worker, by a test's ``module`` and node id: every
    test that needs Ray ("ray": one local cluster at a time, each with a raylet per node, and
    the timings of a node lost or a caller killed measured without a second cluster beside);
    the tests of a module outside tests/unit (its module fixtures, an MLflow server, a kernel,
    a baseline run, start once); a unit test on its own."""
    test = nodeid.split("::", 1)[1] if "::" in nodeid else ""
    if "ray" in needs(module, test):
        return "ray"
    if not module.startswith("unit/"):
        return module
    return nodeid


def is_smoke(module: str, test: str) -> bool:
    return f"{module}::{test}" in SMOKE or f"{module}::{test.split('[', 1)[0]}" in SMOKE


# ----------------------------------------------------------------- -m, on a module's needs
_KNOWN = {*NEEDS_KINDS, "smoke"}


def _evaluate(expr: str, true: set[str]) -> bool:
    """``-m`` ``expr`` (names, and, or, not, parentheses) with the names in ``true`` set."""
    tree = ast.parse(expr, mode="eval")

    def ev(node: ast.AST) -> bool:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Name):
            return node.id in true
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            return not ev(node.operand)
        if isinstance(node, ast.BoolOp):
            values = [ev(v) for v in node.values]
            return all(values) if isinstance(node.op, ast.And) else any(values)
        raise ValueError(f"not a marker expression: {expr!r}")

    return ev(tree)


def may_select(expr: str, module: str) -> bool:
    """Whether ``-m expr`` may select a test of ``module``: False only when it is certain from
    the module's needs (and its smoke tests) alone, whatever the markers written in the
    module itself (``slow``, ``mlflow``) are. An expression this cannot read: True."""
    names = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", expr)) - {"and", "or", "not"}
    unknown = sorted(names - _KNOWN)
    if len(unknown) > 6:
        return True
    variants = [needs(module)]  # the module's tests, and each test with needs of its own
    variants += [needs(module) | set(v) for k, v in NEEDS.items() if module_of(k) == module]
    smoke = [False, True] if any(module_of(s) == module for s in SMOKE) else [False]
    try:
        for base, is_sm, bits in itertools.product(
            variants, smoke, itertools.product([False, True], repeat=len(unknown))
        ):
            true = (
                base
                | {u for u, b in zip(unknown, bits, strict=True) if b}
                | ({"smoke"} if is_sm else set())
            )
            if _evaluate(expr, true):
                return True
    except (SyntaxError, ValueError):
        return True
    return False
