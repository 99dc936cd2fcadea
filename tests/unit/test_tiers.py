"""The test tiers (tests/tiers.py) hold: every test module is classified, what a module is
said to need is what its code starts, the smoke tests exist, and `make test-fast` selects no
module that needs Ray, a kernel, a browser, packaging or the soak."""

from __future__ import annotations

import ast
import re

import tiers
from tiers import FAST_EXPR, FAST_LEAVES_OUT, NEEDS, NEEDS_KINDS, SMOKE, TESTS, may_select

ROOT = TESTS.parent
MODULES = sorted(p.relative_to(TESTS).as_posix() for p in TESTS.rglob("test_*.py"))

# What in a test's code says it needs something: the name of what it starts.
SIGNS = {
    "ray": ("ray.cluster_utils", "raycluster", "ray.init("),
    "kernel": ("kernelharness", "nbclient", "jupyter_client", "KernelManager"),
    "browser": ("chromium",),
    "packaging": ('"build"', '"venv"'),
}


def _make_expr(target: str) -> str:
    """The ``-m`` expression of a Makefile target."""
    text = (ROOT / "Makefile").read_text()
    body = re.search(rf"^{target}:.*\n((?:\t.*\n)+)", text, flags=re.M)
    assert body, f"no target {target} in the Makefile"
    got = re.search(r'pytest .*?-m (?:"([^"]+)"|(\S+))', body.group(1))
    assert got, f"make {target} selects by no marker"
    return got.group(1) or got.group(2)


def test_every_test_module_is_classified():
    outside_unit = [m for m in MODULES if not m.startswith("unit/")]
    assert sorted(set(outside_unit) - set(NEEDS)) == [], "add these to tests/tiers.py NEEDS"
    keys = {k.split("::", 1)[0] for k in NEEDS}
    assert sorted(keys - set(MODULES)) == [], "tests/tiers.py NEEDS names missing modules"
    for key, needs in NEEDS.items():
        assert set(needs) <= set(NEEDS_KINDS), (key, needs)
    for m in MODULES:
        if m.startswith("soak/"):
            assert "soak" in NEEDS[m], m


def test_smoke_tests_exist_and_are_a_dozen():
    assert 8 <= len(SMOKE) <= 16 and len(set(SMOKE)) == len(SMOKE)
    for test_id in SMOKE:
        module, name = test_id.split("::", 1)
        assert module in MODULES, test_id
        tree = ast.parse((TESTS / module).read_text())
        names = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
        assert name in names, f"{test_id}: no such test (tests/tiers.py SMOKE)"
    kinds = {n for s in SMOKE for n in tiers.needs(tiers.module_of(s), s.split("::")[1])}
    assert {"ray", "kernel"} <= kinds  # a Ray call and a notebook cell among them


def _segments(path) -> tuple[str, dict[str, str]]:
    """A module's code outside its tests, and each test's code."""
    text = path.read_text()
    tree = ast.parse(text)
    tests = {}
    rest = text
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
            seg = ast.get_source_segment(text, node) or ""
            tests[node.name] = seg
            rest = rest.replace(seg, "")
    return rest, tests


def test_what_a_module_starts_is_what_it_is_said_to_need():
    wrong = []
    for module in MODULES:
        if module == "unit/test_tiers.py":
            continue  # the signs themselves
        rest, tests = _segments(TESTS / module)
        for kind, signs in SIGNS.items():
            if any(s in rest for s in signs) and kind not in tiers.needs(module):
                wrong.append(f"{module} needs {kind}")
            for name, code in tests.items():
                if any(s in code for s in signs) and kind not in tiers.needs(module, name):
                    wrong.append(f"{module}::{name} needs {kind}")
    assert not wrong, "tests/tiers.py NEEDS is missing: " + ", ".join(wrong)


def test_the_fast_tier_selects_no_module_that_needs_more():
    expr = _make_expr("test-fast")
    assert expr == FAST_EXPR
    for module in MODULES:
        needs = tiers.needs(module)
        if needs & set(FAST_LEAVES_OUT):
            assert not may_select(expr, module), module
        else:
            assert may_select(expr, module), module
    assert not may_select(expr, "system/test_ray.py")
    assert may_select(expr, "system/test_first_steps.py")  # all but its kernel test


def test_the_smoke_tier_imports_only_the_smoke_modules():
    assert _make_expr("test-smoke") == "smoke"
    smoke_modules = {tiers.module_of(s) for s in SMOKE}
    for module in MODULES:
        assert may_select("smoke", module) == (module in smoke_modules), module
    assert may_select("smoke and not slow", "system/test_core.py")  # markers of its own: maybe
    assert not may_select("ray and kernel", "system/test_ray.py")
    assert may_select("ray and kernel", "system/test_ray_cluster.py")
    assert may_select("kernel", "system/test_first_steps.py")  # one test of it


def test_the_markers_are_registered():
    text = (ROOT / "pyproject.toml").read_text()  # (tomllib is Python 3.11+)
    block = re.search(r"^markers = \[\n(.*?)^\]", text, flags=re.M | re.S)
    assert block, "no markers in pyproject.toml's [tool.pytest.ini_options]"
    names = set(re.findall(r'^\s*"(\w+):', block.group(1), flags=re.M))
    assert {*NEEDS_KINDS, "smoke", "slow", "mlflow"} <= names


def test_make_tests_workers_run_ray_tests_and_each_system_module_in_one_group():
    """`tiers.xdist_scope`, the groups of `make test`'s xdist workers: every test that needs
    Ray in one (one cluster at a time), a module outside tests/unit in one (its fixtures
    start once), a unit test alone."""
    ray_modules = [m for m in tiers.NEEDS if "::" not in m and "ray" in tiers.needs(m)]
    assert len(ray_modules) >= 4
    for m in ray_modules:
        assert tiers.xdist_scope(m, f"tests/{m}::test_x[a-b]") == "ray"
    core = "system/test_core.py"
    assert tiers.xdist_scope(core, f"tests/{core}::test_timeout") == core
    assert tiers.xdist_scope(core, f"tests/{core}::test_cancel") == core
    unit = "tests/unit/test_log.py::test_a"
    assert tiers.xdist_scope("unit/test_log.py", unit) == unit
