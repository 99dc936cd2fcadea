"""Run every benchmark (each in its own warm caller process), then write
``bench/out/results.json``, the chart ``docs/benchmarks.png`` and ``docs/benchmarks.md``.

    PYTHONPATH=src python bench/run_all.py --reps 5

``--only relaunch,failure`` runs a subset: the documents are rewritten from what ran, and
each benchmark that did not run keeps its section as the current ``docs/benchmarks.md`` has
it. Everything below `KEEP_MARK` in that file (one-off comparisons written by hand) is kept.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time

BENCH = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH)
OUT = os.path.join(BENCH, "out")
DOCS = os.path.join(ROOT, "docs")
ORDER = [
    "relaunch",
    "failure",
    "ddp",
    "transfer",
    "output",
    "parent",
    "gang",
    "notebook",
    "watch",
    "tables",
    "checkpoint",
]

# (benchmark, ratio or figure, label, target, "le"/"ge"/"eq")
TARGETS = [
    ("relaunch", "warm_vs_mp_spawn", "warm relaunch / mp.spawn", 0.25, "le"),
    ("relaunch", "warm_vs_accelerate", "warm relaunch / Accelerate", 1.5, "le"),
    ("relaunch", "cold_vs_mp_spawn", "cold launch / mp.spawn", 1.0, "le"),
    ("relaunch", "warm_vs_elastic_launch", "warm relaunch / elastic_launch", None, "le"),
    ("failure", "gangrun_vs_mp_spawn", "failure surfacing / mp.spawn", 0.25, "le"),
    ("failure", "gangrun_vs_elastic_launch", "failure surfacing / elastic_launch", None, "le"),
    ("ddp", "gangrun_vs_torchrun", "DDP steps/s / torchrun", 0.98, "ge"),
    ("transfer", "gangrun_vs_save_load", "256 MiB x2 result / torch.save+load", 1.5, "le"),
    ("output", "all_vs_none", "200k lines x2: output=all / none", None, "le"),
    ("gang", "fresh_call_vs_gang", "fresh .distributed() / warm gang execute", None, "ge"),
    ("gang", "ipyparallel_vs_gang", "ipyparallel execute / warm gang execute", None, "ge"),
    ("notebook", "panel_on_vs_off", "warm relaunch in a kernel: panel on / off", None, "le"),
    ("notebook", "first_vs_warm", "first call 3 s after decorating / warm relaunch", 1.5, "le"),
    (
        "watch",
        "relaunch_progress_grid_on_vs_off",
        "kernel relaunch: progress+grid on / off",
        1.1,
        "le",
    ),
    ("watch", "loop_report_vs_none", "10k-step loop: report_step every step / none", 1.01, "le"),
    ("tables", "gangrun_vs_pyarrow_dataset", "2x2 table epoch rows/s / pyarrow.dataset", 0.9, "ge"),
    ("tables", "gangrun_vs_hf_streaming", "2x2 table epoch rows/s / HF datasets", None, "ge"),
    ("tables", "s3_warm_vs_cold", "table epoch from S3: warm / cold cache", None, "ge"),
    (
        "checkpoint",
        "async_blocked_vs_prealloc_copy",
        "step blocked by async save / copy into buffers allocated beforehand",
        2.0,
        "le",
    ),
    (
        "checkpoint",
        "async_blocked_vs_dcp_sync",
        "step blocked by async save / sync DCP save (1 GiB x2)",
        None,
        "le",
    ),
    (
        "checkpoint",
        "async_blocked_vs_torch_save_fsync",
        "step blocked by async save / torch.save+fsync",
        None,
        "le",
    ),
    (
        "checkpoint",
        "restore_vs_torch_load",
        "Checkpointer.restore / torch.load (1 GiB x2)",
        None,
        "le",
    ),
]
COMMAND = "PYTHONPATH=src python bench/run_all.py --reps 5"
KEEP_MARK = "<!-- written by hand: bench/run_all.py keeps everything below this line -->"


def existing_sections(text: str) -> tuple[dict[str, str], str]:
    """The current document's per-benchmark sections (``### name`` to the next heading) and
    its hand-written tail (from `KEEP_MARK` on)."""
    head, _, tail = text.partition(KEEP_MARK)
    sections: dict[str, str] = {}
    targets = head.partition("## Targets")[2].partition("\n## ")[0]
    for line in targets.splitlines():  # the Targets table's rows, by label: "targets:<label>"
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0] not in ("measure", "---"):
            sections[f"targets:{cells[0]}"] = line
    name, lines = None, []
    for line in head.splitlines():
        if line.startswith("#"):
            if name is not None:
                sections[name] = "\n".join(lines).rstrip() + "\n"
            name = line[4:].strip() if line.startswith("### ") else None
            lines = [line]
        elif name is not None:
            lines.append(line)
    if name is not None:
        sections[name] = "\n".join(lines).rstrip() + "\n"
    return sections, (KEEP_MARK + tail) if tail or KEEP_MARK in text else ""


def run_one(name: str, reps: int) -> dict:
    path = os.path.join(OUT, f"{name}.json")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [os.path.join(ROOT, "src"), BENCH] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    )
    t = time.time()
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(BENCH, f"bench_{name}.py"),
            "--reps",
            str(reps),
            "--out",
            path,
        ],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        print(proc.stdout[-4000:], proc.stderr[-4000:], file=sys.stderr)
        return {"name": name, "error": proc.stderr[-2000:], "wall_s": time.time() - t}
    with open(path) as f:
        res = json.load(f)
    res["wall_s"] = time.time() - t
    return res


def environment() -> dict:
    import torch

    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": len(os.sched_getaffinity(0)),
        "machine": platform.machine(),
        "kernel": platform.release(),
        "loadavg_at_start": os.getloadavg()[0],
    }


def verdicts(results: dict) -> list[dict]:
    rows = []
    for bench, key, label, target, op in TARGETS:
        r = results.get(bench, {}).get("ratios", {}).get(key)
        ok = None
        if r is not None and target is not None:
            ok = r <= target if op == "le" else r >= target
        rows.append({"label": label, "value": r, "target": target, "op": op, "ok": ok})
    f = results.get("failure", {}).get("results", {}).get("gangrun", {}).get("median")
    rows.append(
        {
            "label": "failure surfacing, s",
            "value": f,
            "target": 0.1,
            "op": "le",
            "ok": None if f is None else f <= 0.1,
        }
    )
    lost = results.get("output", {}).get("lost_lines")
    if lost is not None:
        n = sum(lost) + results["output"].get("garbled_lines", 0)
        rows.append(
            {"label": "output lines lost", "value": n, "target": 0, "op": "le", "ok": n == 0}
        )
    g = results.get("gang", {}).get("results", {}).get("gang_execute", {}).get("median")
    if g is not None:
        rows.append(
            {
                "label": "warm 2-rank gang execute round trip, ms",
                "value": g * 1000,
                "target": 10,
                "op": "le",
                "ok": g * 1000 <= 10,
            }
        )
    imp = results.get("parent", {}).get("results", {}).get("import_s", {}).get("median")
    if imp is not None:
        rows.append(
            {
                "label": "import gangrun, ms",
                "value": imp * 1000,
                "target": 50,
                "op": "le",
                "ok": imp * 1000 < 50,
            }
        )
    return rows


def chart(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rs = [r for r in rows if r["value"] is not None and "/" in r["label"]]
    fig, ax = plt.subplots(figsize=(9, 0.5 * len(rs) + 1.5))
    ys = list(range(len(rs)))[::-1]
    colors = [
        "tab:green" if r["ok"] else ("tab:red" if r["ok"] is False else "tab:gray") for r in rs
    ]
    ax.barh(ys, [r["value"] for r in rs], color=colors)
    for y, r in zip(ys, rs, strict=True):
        ax.text(r["value"], y, f" {r['value']:.3g}", va="center", fontsize=8)
        if r["target"] is not None:
            ax.plot([r["target"]] * 2, [y - 0.4, y + 0.4], color="black", lw=1.5)
    ax.set_yticks(ys)
    ax.set_yticklabels([r["label"] for r in rs], fontsize=8)
    ax.axvline(1.0, color="gray", ls=":", lw=1)
    ax.set_xscale("log")
    ax.set_xlabel("ratio, gangrun / baseline (log scale; black tick = target, green = met)")
    ax.set_title("gangrun vs peers (2 ranks, medians)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _fmt(x: float | None, unit: str = "") -> str:
    if x is None:
        return "n/a"
    if unit == "s":
        return f"{x * 1000:.0f} ms" if x < 1 else f"{x:.2f} s"
    return f"{x:.3g}"


def markdown(results: dict, rows: list[dict], env: dict, kept: dict[str, str] | None = None) -> str:
    kept = kept or {}
    out = [
        "# Benchmarks",
        "",
        "gangrun against the launchers a notebook user would otherwise reach for: warm parent,",
        "2 ranks on CPU (gloo), medians of repeated runs, methods interleaved within each",
        "repetition. gangrun runs with `mlflow=False` (the baselines track nothing).",
        "",
        "Reproduce (from the repository root, on a quiet machine):",
        "",
        "```",
        COMMAND,
        "```",
        "",
        "It rewrites `bench/out/results.json`, this file and the chart. Each benchmark can also",
        "run alone: `PYTHONPATH=src python bench/bench_relaunch.py --reps 5`.",
        "",
        f"Last run: {env.get('date')}, Python {env.get('python')}, torch {env.get('torch')}, "
        f"{env.get('cpus')} CPUs ({env.get('machine')}, Linux {env.get('kernel')}), "
        f"load average at start {env.get('loadavg_at_start', 0):.1f}"
        + (
            f" (that run: {', '.join(env['ran'])}; the rest from earlier runs)."
            if env.get("ran")
            else "."
        ),
        "",
        "![ratios](benchmarks.png)",
        "",
        "## Targets",
        "",
        "| measure | value | target | met |",
        "|---|---|---|---|",
    ]
    for r in rows:
        tgt = (
            ""
            if r["target"] is None
            else ("<= " if r["op"] == "le" else ">= ") + f"{r['target']:g}"
        )
        met = {True: "yes", False: "**no**", None: ""}[r["ok"]]
        if r["value"] is None:  # not run this time: the row as it was, if there was one
            if f"targets:{r['label']}" in kept:
                out.append(kept[f"targets:{r['label']}"])
            continue
        out.append(f"| {r['label']} | {_fmt(r['value'])} | {tgt} | {met} |")
    labels = {f"targets:{r['label']}" for r in rows}
    out += [v for k, v in kept.items() if k.startswith("targets:") and k not in labels]
    out += ["", "## Medians", ""]
    for name in ORDER:
        res = results.get(name)
        if not res:
            if name in kept:  # not run this time: the section as it was
                out += [kept[name].rstrip(), ""]
            continue
        out.append(f"### {name}")
        out.append("")
        if "error" in res:
            out += ["```", res["error"], "```", ""]
            continue
        unit = res.get("unit", "s")
        out += ["| what | median | min | max | n |", "|---|---|---|---|---|"]
        for k, v in res.get("results", {}).items():
            u = unit if unit == "s" else ""
            out.append(
                f"| {k} | {_fmt(v['median'], u)} | {_fmt(v['min'], u)} | {_fmt(v['max'], u)} "
                f"| {v['n']} |"
            )
        extra = {
            k: v for k, v in res.items() if k not in ("results", "ratios", "name", "unit", "wall_s")
        }
        if extra:
            out.append("")
            out.append("Also: " + ", ".join(f"`{k}` = {json.dumps(v)}" for k, v in extra.items()))
        if res.get("ratios"):
            out.append("")
            out.append("Ratios: " + ", ".join(f"`{k}` = {v:.3g}" for k, v in res["ratios"].items()))
        out.append("")
    out += [
        "## What is measured",
        "",
        "1. **relaunch**: wall time of one call of a function that imports torch. gangrun *cold*",
        "   starts a new fork server each time (the first call of a session); *warm* reuses it;",
        '   `gangrun_spawn` is `start_method="spawn"`. Baselines: `torch.multiprocessing.spawn`,',
        "   `elastic_launch` (torchrun's engine, `monitor_interval=0.1`), Accelerate's",
        "   `notebook_launcher` (forks the caller, which imported torch but never CUDA).",
        "2. **failure**: rank 1 raises 0.3 s after `init_process_group` while rank 0 blocks in a",
        "   gloo `all_reduce`; time from rank 1's raise to the exception in the caller.",
        "3. **ddp**: `bench/ddp_train.py` (2-layer MLP, DDP, SGD) steps/s on rank 0 under gangrun",
        "   and `torchrun --standalone`, both with the same `OMP_NUM_THREADS` (cores / ranks).",
        "4. **transfer**: 2 ranks each return a 256 MiB float32 tensor; gangrun's cost is the call",
        "   minus the same call returning nothing. Baseline: `torch.save` of both tensors into",
        "   the same temp directory and `torch.load` back.",
        "5. **output**: 2 ranks print 200k numbered lines each (with a little compute); the caller's",
        "   `sys.stdout` checks every line arrived once, whole, with its `[rank N]` prefix.",
        "6. **parent**: `import gangrun` in a fresh interpreter (and that it imports no torch,",
        "   mlflow, ray or numpy); the caller's RSS growth per call over 20+ calls.",
        '7. **gang**: round trip of `g.execute("1")` on a warm 2-rank `gangrun.Gang`, next to a',
        "   fresh `.distributed()` call of a trivial function and ipyparallel's",
        "   `rc[:].execute(..., block=True)` on 2 engines (the `%px` path), in one run.",
        "8. **notebook**: in a real kernel (`jupyter_client`): a warm relaunch with the live panel",
        "   on and off; the first call made 3 s after decorating (fork server prewarmed, and the",
        "   modules a call needs imported, in the background; `BENCH_FIRST_WAIT_S` changes the",
        "   pause) and a cold first call, next to the warm relaunch.",
        "9. **watch**: the cost of watching a run. In a real kernel, 2 ranks, MLflow on in",
        "   both variants (the grid needs it; the fork server preloads mlflow): a warm relaunch",
        "   with the live panel (progress line, per-rank rows, chart grid) and a function that calls",
        "   `gangrun.report_step` at each of its 200 steps and logs a metric, against",
        "   `progress=False` and the same function without `report_step`; interleaved, both",
        "   orders. Then a 10,000-step training loop (MLP forward, backward, SGD step, one thread)",
        "   in a real rank with and without `report_step(step, total)` at every step, alternating",
        "   every 500 steps in the same process; the cost of one call; and the panel thread's own",
        "   work per redraw and per metrics read.",
        "10. **tables**: rows/s of a 2-rank x 2-worker `TableDataset` epoch over 8 Parquet files",
        "    (2M rows), timed in the ranks, against one process scanning them with",
        "    `pyarrow.dataset`, HF `datasets` streaming them with `split_dataset_by_node` (2x2",
        "    too), and the same epoch from loopback S3 (moto) with a cold and a warm cache.",
        "11. **checkpoint**: 2 ranks, 1 GiB of FSDP2-sharded state each, local disk: the time a",
        "    training step is blocked by `Checkpointer.save()` with async saves (the copy off the",
        "    parameters), against a synchronous DCP save and `torch.save` (+ `fsync`) of the same",
        "    shards; `Checkpointer.restore()` against `torch.load` (`bench/bench_checkpoint.py`).",
        "",
    ]
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--only", default="")
    ap.add_argument("--render", action="store_true", help="only rewrite the docs from results")
    a = ap.parse_args()
    os.makedirs(OUT, exist_ok=True)
    os.makedirs(DOCS, exist_ok=True)
    names = [n for n in ORDER if not a.only or n in a.only.split(",")]
    env = environment()
    results: dict = {}
    prev = os.path.join(OUT, "results.json")
    if (a.only or a.render) and os.path.exists(prev):
        with open(prev) as f:
            saved = json.load(f)
        results = saved.get("benchmarks", {})
        if a.render:
            env, a.reps, names = saved.get("environment", env), saved.get("reps", a.reps), []
    if a.only and not a.render:
        env["ran"] = names
    for n in names:
        print(f"== {n}", flush=True)
        results[n] = run_one(n, a.reps)
        print(json.dumps(results[n].get("ratios", results[n].get("error"))), flush=True)
    doc = os.path.join(DOCS, "benchmarks.md")
    kept, tail = ({}, "")
    if os.path.exists(doc):
        with open(doc) as f:
            kept, tail = existing_sections(f.read())
    rows = verdicts(results)
    for r in rows:  # not run now: the chart shows the figure the document keeps
        if r["value"] is None and f"targets:{r['label']}" in kept:
            cells = [c.strip() for c in kept[f"targets:{r['label']}"].strip().strip("|").split("|")]
            try:
                r["value"] = float(cells[1])
            except ValueError:
                continue
            if r["target"] is not None:
                v, t = r["value"], r["target"]
                r["ok"] = v <= t if r["op"] == "le" else v >= t
    with open(prev, "w") as f:
        json.dump(
            {"environment": env, "reps": a.reps, "benchmarks": results, "targets": rows},
            f,
            indent=2,
        )
    chart(rows, os.path.join(DOCS, "benchmarks.png"))
    with open(doc, "w") as f:
        f.write(markdown(results, rows, env, kept) + ("\n" + tail if tail else ""))
    for r in rows:
        print(f"{r['label']:45s} {_fmt(r['value']):>10s}  {r['ok']}")


if __name__ == "__main__":
    main()
