"""The ``gangrun`` command: run a script on every rank, or show what a rank would see.

    gangrun run [--gpus N | --processes N] [--timeout S] [--backend ray] [--address A]
                [--no-mlflow] [--output all|rank0|none] script.py [args...]
    gangrun run [...] -m package.module [args...]
    gangrun info [--gpus N | --processes N] [--json]

``run`` executes the script as ``__main__`` (``runpy``, ``sys.argv`` = the script and its
arguments) on every rank, with the same guarantees as ``@distributed``: torchrun's
environment, live ``[rank N]`` output, fail-fast teardown, nothing left behind. Its exit
status reflects the root cause: the failing rank's exit code (1 for an exception),
128+N when a rank died by signal N, 124 on timeout, 130 when interrupted (Ctrl-C), 143 on
SIGTERM, 2 when nothing could be started (bad arguments, no GPU...).
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import signal
import sys
from typing import Any

EXIT_LAUNCH = 2
EXIT_TIMEOUT = 124
EXIT_INTERRUPT = 130


class ScriptTarget:
    """A script or module to run as ``__main__`` on a rank (picklable by reference)."""

    def __init__(self, target: str, argv: list[str], module: bool = False) -> None:
        self.target = target if module else os.path.abspath(target)
        self.argv = [str(a) for a in argv]
        self.module = module
        self.__name__ = self.__qualname__ = target
        # The script's text travels too: on another node (backend="ray") the path may not exist.
        self.source: bytes | None = None
        if not module:
            with open(self.target, "rb") as f:
                self.source = f.read()

    def _script_path(self) -> str:
        if os.path.isfile(self.target) or self.source is None:
            return self.target
        where = os.environ.get("GANGRUN_RUN_DIR") or "."
        path = os.path.join(where, os.path.basename(self.target))
        with open(path, "wb") as f:
            f.write(self.source)
        return path

    def __call__(self) -> None:
        if self.module:
            sys.argv = [self.target, *self.argv]  # runpy puts the module's path in argv[0]
            if "" not in sys.path and os.getcwd() not in sys.path:
                sys.path.insert(0, os.getcwd())  # as `python -m` does
            runpy.run_module(self.target, run_name="__main__", alter_sys=True)
        else:
            path = self._script_path()
            sys.argv = [path, *self.argv]
            sys.path.insert(0, os.path.dirname(path))  # as `python script.py` does
            runpy.run_path(path, run_name="__main__")

    def __repr__(self) -> str:
        kind = "-m " if self.module else ""
        return f"<script {kind}{self.target} {' '.join(self.argv)}>".replace(" >", ">")


def exit_code_for(err: BaseException) -> int:
    """The process exit status that reflects a failed call's root cause."""
    from .errors import (
        DistributedCancelledError,
        DistributedError,
        DistributedTimeoutError,
        LaunchError,
    )

    if isinstance(err, DistributedTimeoutError):
        return EXIT_TIMEOUT
    if isinstance(err, DistributedCancelledError):
        return EXIT_INTERRUPT
    if isinstance(err, LaunchError):
        return EXIT_LAUNCH
    if isinstance(err, DistributedError) and err.exitcode is not None:
        code = int(err.exitcode)
        if code < 0:
            return 128 + (-code)
        return code & 0xFF or 1
    return 1


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="gangrun",
        description="Run a PyTorch training script on every GPU of this node (or a Ray cluster).",
    )
    sub = p.add_subparsers(dest="cmd", required=True)

    def world(sp: argparse.ArgumentParser) -> None:
        g = sp.add_mutually_exclusive_group()
        g.add_argument("--gpus", type=int, help="ranks, one GPU each (default: every GPU)")
        g.add_argument("--processes", "--nproc", type=int, help="CPU ranks (gloo), no GPU needed")
        sp.add_argument("--gpu-type", help="require this accelerator, e.g. H100")
        sp.add_argument("--backend", choices=("local", "ray"), default="local")
        sp.add_argument("--address", help="Ray cluster address (backend ray; default RAY_ADDRESS)")

    run = sub.add_parser(
        "run",
        help="run a script (or -m module) on every rank",
        description="Run a script on every rank, as `python script.py args` would.",
    )
    world(run)
    run.add_argument(
        "--timeout",
        default="10800",
        help="seconds for the whole run (default 10800); 0 or 'none' disables",
    )
    run.add_argument("--no-mlflow", action="store_true", help="do not create an MLflow run")
    run.add_argument("--output", choices=("all", "rank0", "none"), default="all")
    run.add_argument("--max-restarts", type=int, default=0)
    run.add_argument("--log-dir", help="keep every rank's log under this directory")
    run.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra environment variable for every rank (repeatable)",
    )
    run.add_argument("-m", dest="module", metavar="MODULE", help="run a module, like python -m")
    run.add_argument("target", nargs="*", help="script.py [args...]")

    info = sub.add_parser("info", help="show the accelerators and the environment of a rank")
    world(info)
    info.add_argument("--json", action="store_true", help="machine-readable output")
    return p


def _timeout(text: str) -> float | None:
    if text.strip().lower() in ("0", "none", "inf", ""):
        return None
    return float(text)


def _env(pairs: list[str]) -> dict[str, str]:
    out = {}
    for item in pairs:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"gangrun: --env takes KEY=VALUE, got {item!r}")
        out[key] = value
    return out


class _Terminated(BaseException):
    pass


def _on_sigterm(signum: int, frame: Any) -> None:
    raise _Terminated


def cmd_run(ns: argparse.Namespace) -> int:
    from .api import DistributedFunction, Options
    from .errors import DistributedError

    if ns.module:
        target = ScriptTarget(ns.module, ns.target, module=True)
    else:
        if not ns.target:
            print("gangrun run: give a script (or -m module) to run", file=sys.stderr)
            return EXIT_LAUNCH
        script, *args = ns.target
        if not os.path.isfile(script):
            print(f"gangrun run: no such script: {script}", file=sys.stderr)
            return EXIT_LAUNCH
        target = ScriptTarget(script, args)
    try:
        opts = Options(
            gpus=ns.gpus,
            processes=ns.processes,
            gpu_type=ns.gpu_type,
            timeout=_timeout(ns.timeout),
            mlflow=not ns.no_mlflow,
            env=_env(ns.env),
            max_restarts=ns.max_restarts,
            output=ns.output,
            backend=ns.backend,
            address=ns.address,
            log_dir=ns.log_dir,
        ).validate()
    except (DistributedError, ValueError) as exc:
        print(f"gangrun: {exc}", file=sys.stderr)
        return EXIT_LAUNCH
    fn: DistributedFunction[[], None] = DistributedFunction(target, opts)
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    handle = None
    try:
        handle = fn.submit()
        handle.result()
        return 0
    except DistributedError as exc:
        hint = (
            "" if ns.log_dir else "\n(the logs go away with this command: --log-dir DIR keeps them)"
        )
        print(f"gangrun: {exc}{hint if exc.rank is not None else ''}", file=sys.stderr)
        return exit_code_for(exc)
    except KeyboardInterrupt:
        if handle is not None:
            handle._run.cancel("interrupted", wait=60.0)
        print("gangrun: interrupted; every rank was stopped.", file=sys.stderr)
        return EXIT_INTERRUPT
    except _Terminated:
        if handle is not None:
            handle._run.cancel("terminated (SIGTERM)", wait=60.0)
        print("gangrun: terminated; every rank was stopped.", file=sys.stderr)
        return 128 + signal.SIGTERM
    finally:
        signal.signal(signal.SIGTERM, previous)


_SHOWN = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "NODE_RANK",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "OMP_NUM_THREADS",
    "CUDA_VISIBLE_DEVICES",
    "PYTHONUNBUFFERED",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "MLFLOW_TRACKING_URI",
)


def cmd_info(ns: argparse.Namespace) -> int:
    from . import __version__, accelerators
    from .api import Options
    from .errors import DistributedError
    from .lifecycle.plan import plan_local, rank_specs

    devs = accelerators.detect()
    report: dict[str, Any] = {
        "gangrun": __version__,
        "python": sys.version.split()[0],
        "accelerators": [{"index": d.index, "name": d.name, "uuid": d.uuid} for d in devs],
        "cpus": os.cpu_count(),
    }
    try:
        import importlib.metadata as md

        for pkg in ("torch", "mlflow", "ray", "deepspeed"):
            try:
                report[pkg] = md.version(pkg)
            except md.PackageNotFoundError:
                report[pkg] = None
    except Exception:  # pragma: no cover
        pass
    rank_env: dict[str, str] | None = None
    note = None
    if ns.backend == "ray":
        note = "backend ray: LOCAL_RANK, NODE_RANK, MASTER_ADDR and devices are set per node"
    try:
        opts = Options(gpus=ns.gpus, processes=ns.processes, gpu_type=ns.gpu_type).validate()
        plan = plan_local(lambda: None, opts)  # what a call would do; reserves no GPU
        devices = plan.devices[: plan.gpus_wanted]
        env = rank_specs(plan, opts, run_dir="<run dir>", devices=devices)[0].env
        rank_env = {k: env[k] for k in _SHOWN if k in env}
        report["world_size"] = plan.world_size
    except DistributedError as exc:
        note = str(exc)
    report["rank0_env"] = rank_env
    if note:
        report["note"] = note
    if ns.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"gangrun {report['gangrun']} (python {report['python']}, {report['cpus']} CPUs)")
    libs = ", ".join(f"{k} {report.get(k) or '-'}" for k in ("torch", "mlflow", "ray", "deepspeed"))
    print(f"libraries: {libs}")
    if devs:
        print(f"accelerators ({len(devs)}):")
        for d in devs:
            print(f"  {d.index}: {d.name}" + (f" ({d.uuid})" if d.uuid else ""))
    else:
        print("accelerators: none found (use --processes N for CPU ranks)")
    if rank_env is not None:
        print(f"environment of rank 0 of {report['world_size']}:")
        for k, v in rank_env.items():
            print(f"  {k}={v}")
    if note:
        print(f"note: {note}")
    return 0


_VALUED = {
    "--gpus",
    "--processes",
    "--nproc",
    "--gpu-type",
    "--backend",
    "--address",
    "--timeout",
    "--output",
    "--max-restarts",
    "--log-dir",
    "--env",
}


def _split_run(args: list[str]) -> tuple[list[str], list[str], str | None]:
    """``[gangrun options] (script.py | -m module) [its args]`` -> (ours, its, module):
    everything from the script (or after ``-m module``) on belongs to the script."""
    i = 0
    while i < len(args):
        a = args[i]
        if a == "--":
            return args[:i], args[i + 1 :], None
        if a == "-m" or (a.startswith("-m") and len(a) > 2 and not a.startswith("--")):
            mod = a[2:] if len(a) > 2 else (args[i + 1] if i + 1 < len(args) else None)
            rest = args[i + 1 :] if len(a) > 2 else args[i + 2 :]
            return args[:i], rest, mod
        if a.startswith("-"):
            i += 2 if a in _VALUED else 1
            continue
        return args[:i], args[i:], None
    return args, [], None


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "run":
        ours, theirs, module = _split_run(args[1:])
        ns = _parser().parse_args(["run", *ours])
        ns.module = module
        ns.target = theirs
        if module is None and not theirs:
            print("gangrun run: give a script (or -m module) to run", file=sys.stderr)
            return EXIT_LAUNCH
        return cmd_run(ns)
    ns = _parser().parse_args(args)
    if ns.cmd == "run":  # pragma: no cover - handled above
        return cmd_run(ns)
    return cmd_info(ns)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
