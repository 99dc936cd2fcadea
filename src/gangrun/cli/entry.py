"""The ``gangrun`` command: run a script on every rank, or show what a rank would see.

    gangrun run [--gpus N | --gpus I,J | --processes N] [--timeout 2h] [every option...]
                script.py [args...]
    gangrun run [...] -m package.module [args...]
    gangrun info [options...] [--json] [--check]
    gangrun ps [--function NAME] | logs RUN [--rank N] [--follow] | stacks RUN | stop RUN
    gangrun checkpoints URL [--json] [--checksums]
    gangrun --version

Every option of ``@distributed`` has a flag (``gangrun run --help``); options not given come
from ``GANGRUN_<OPTION>`` variables, then the built-in defaults.

``run`` executes the script as ``__main__`` (``runpy``, ``sys.argv`` = the script and its
arguments) on every rank, with the same guarantees as ``@distributed``: torchrun's
environment, live ``[rank N]`` output, fail-fast teardown, nothing left behind. Its exit
status reflects the root cause: the failing rank's exit code (1 for an exception),
128+N when a rank died by signal N, 124 on timeout, 130 when interrupted (Ctrl-C), 143 on
SIGTERM, 2 when nothing could be started (bad arguments, no GPU...). A failure's message
ends with the paths of the ranks' log files: under ``--log-dir``, or else moved to a private
``gangrun-logs-<run>-*`` directory in the temp dir that stays after the command.
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import signal
import sys
from typing import IO, TYPE_CHECKING, Any

from ..wire import contract
from .support import (
    module_file,
    option_rows,
    print_rows,
    setting_rows,
    unknown_flag,
    with_log_paths,
)

if TYPE_CHECKING:
    from ..api import RunHandle

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
        # The file the MLflow run names as its source (mlflow.source.name, and its git commit).
        self.source_file: str = self.target if not module else module_file(target)
        if not module:
            with open(self.target, "rb") as f:
                self.source = f.read()

    def _script_path(self) -> str:
        if os.path.isfile(self.target) or self.source is None:
            return self.target
        where = os.environ.get(contract.RUN_DIR) or "."
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
    from ..errors import (
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


def _parsers() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser, argparse.ArgumentParser]:
    """(top level, ``run``, ``info``) parsers."""
    from .. import __version__
    from .options import add_option_flags

    fmt = argparse.RawDescriptionHelpFormatter
    p = argparse.ArgumentParser(
        prog="gangrun",
        description="Run a PyTorch training script on every GPU of this node (or a Ray cluster).",
        epilog=EXAMPLES,
        formatter_class=fmt,
    )
    p.add_argument("--version", action="version", version=f"gangrun {__version__}")
    sub = p.add_subparsers(
        dest="cmd", required=True, metavar="{run,info,ps,logs,stacks,stop,checkpoints}"
    )
    # No abbreviated flags: a prefix would be taken for an option here, or split the
    # command line wrongly (its value taken for the script); a misspelling gets "did you mean".
    run = sub.add_parser(
        "run",
        allow_abbrev=False,
        help="run a script (or -m module) on every rank",
        description="Run a script on every rank, as `python script.py args` would. Options not "
        f"given here come from {contract.option_var('<option>')} variables, then the built-in "
        "defaults.",
        epilog=RUN_EXAMPLES,
        formatter_class=fmt,
    )
    add_option_flags(run)
    run.add_argument("-m", dest="module", metavar="MODULE", help="run a module, like python -m")
    run.add_argument("target", nargs="*", help="script.py [args...]")
    info = sub.add_parser(
        "info",
        allow_abbrev=False,
        help="show the GPUs, the effective defaults and the environment of a rank",
        description="Show the GPUs found (free memory, other processes), the option defaults "
        "in force and where each comes from, and the environment rank 0 would get.",
        epilog=INFO_EXAMPLES,
        formatter_class=fmt,
    )
    add_option_flags(info)
    info.add_argument("--json", action="store_true", help="machine-readable output")
    info.add_argument(
        "--check",
        action="store_true",
        help=f"exit 1 when a {contract.PREFIX}* variable is rejected (its value cannot be used)",
    )
    from .node import add_node_commands

    add_node_commands(sub)  # ps, logs, stacks, stop: this user's calls on this node
    from .checkpoints import add_checkpoints_command

    add_checkpoints_command(sub)  # a checkpoint location's checkpoints, verified
    return p, run, info


def _parser() -> argparse.ArgumentParser:
    return _parsers()[0]


EXAMPLES = """examples:
  gangrun run --processes 2 train.py --lr 1e-3     2 CPU ranks (gloo)
  gangrun run --gpus 4 --timeout 2h train.py       4 GPUs, stop after 2 hours
  gangrun run --gpus 0,3 -m pkg.train              GPUs 0 and 3, a module
  gangrun info                                     GPUs, defaults, a rank's environment
  gangrun ps                                       your running calls on this node
  gangrun logs RUN --rank 1 --follow               a call's output, from another terminal
  gangrun stacks RUN / gangrun stop RUN            its ranks' stacks / stop it
  gangrun stop train                               RUN: a run id, or the function's name
  gangrun checkpoints s3://bucket/ckpt/run         complete, damaged, partial checkpoints
  gangrun run --help                               every option of run
"""
RUN_EXAMPLES = f"""durations: 90, 90s, 15m, 2h, 1h30m, or none (no limit); the same in Python (timeout="2h").
every option can be defaulted by {contract.option_var("<option>")} (e.g. {contract.option_var("timeout")}=2h).

examples:
  gangrun run --processes 2 train.py --lr 1e-3
  gangrun run --gpus 8 --gpu-type H100 --timeout 2h --max-restarts 2 train.py
  gangrun run --gpus 0,3 --gpu-wait 10m --log-dir logs/ -m pkg.train --epochs 3
  gangrun run --backend ray --address head:6379 --gpus 16 train.py
  gangrun run --processes 2 --env OMP_NUM_THREADS=4 --no-mlflow -- -odd-name.py
"""
INFO_EXAMPLES = """examples:
  gangrun info
  gangrun info --processes 4 --json
  gangrun info --check          exit 1 when a variable's value is rejected
"""


class _Terminated(BaseException):
    pass


def _on_sigterm(signum: int, frame: Any) -> None:
    raise _Terminated


def cmd_run(ns: argparse.Namespace, run_parser: argparse.ArgumentParser | None = None) -> int:
    from .. import defaults as _defaults
    from ..api import DistributedFunction, Options, submit_wired
    from ..errors import DistributedError
    from .options import options_from_args, speak_cli

    def usage_error(message: str) -> int:
        if run_parser is None:
            print(f"gangrun run: {message}", file=sys.stderr)
            return EXIT_LAUNCH
        run_parser.error(message)  # prints run's usage, exits 2
        return EXIT_LAUNCH  # pragma: no cover

    if ns.module:
        target = ScriptTarget(ns.module, ns.target, module=True)
    else:
        if not ns.target:
            return usage_error("give a script (or -m module) to run")
        script, *args = ns.target
        if not os.path.isfile(script):
            return usage_error(f"no such script: {script}")
        target = ScriptTarget(script, args)
    explicit = options_from_args(ns)
    try:
        Options(**explicit).validate()
    except DistributedError as exc:  # a bad flag value
        return usage_error(speak_cli(exc))
    try:
        opts = _defaults.resolve(explicit)  # GANGRUN_* variables: errors name the variable
    except DistributedError as exc:
        print(f"gangrun: {speak_cli(exc)}", file=sys.stderr)
        return EXIT_LAUNCH
    fn: DistributedFunction[[], None] = DistributedFunction(target, explicit=explicit)
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    handle = status = None
    try:
        from .status import start

        def submit(out: IO[str], err: IO[str]) -> RunHandle[None]:
            return submit_wired(fn, (), {}, {"stdout": out, "stderr": err, "caller": "gangrun run"})

        # a status line with the progress when stderr is a terminal
        handle, status = start(submit, sys.stdout, sys.stderr)
        handle.result()
        return 0
    except DistributedError as exc:
        text = speak_cli(exc)
        if handle is not None:
            text = with_log_paths(
                text, handle.supervisor.log_files(), handle.run_id, bool(opts.log_dir)
            )
        print(f"gangrun: {text}", file=sys.stderr)
        return exit_code_for(exc)
    except KeyboardInterrupt:
        if handle is not None:
            handle.cancel(wait=60.0, reason="interrupted")
        print("gangrun: interrupted; every rank was stopped.", file=sys.stderr)
        return EXIT_INTERRUPT
    except _Terminated:
        if handle is not None:
            handle.cancel(wait=60.0, reason="terminated (SIGTERM)")
        print("gangrun: terminated; every rank was stopped.", file=sys.stderr)
        return 128 + signal.SIGTERM
    finally:
        if status is not None:
            status.close()
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
    import dataclasses
    import getpass

    from .. import __version__
    from .. import defaults as _defaults
    from ..errors import DistributedError
    from ..host import accelerators
    from ..lifecycle.plan import plan_local, rank_specs
    from ..wire.security import redact
    from .options import options_from_args, speak_cli

    devs = accelerators.detect()
    usage = accelerators.gpu_usage() if devs else None
    report: dict[str, Any] = {
        "gangrun": __version__,
        "python": sys.version.split()[0],
        "accelerators": [
            {"index": d.index, "name": d.name, "uuid": d.uuid}
            | (dataclasses.asdict(usage[d.index]) if usage and d.index in usage else {})
            for d in devs
        ],
        "cpus": os.cpu_count(),
    }
    try:
        import importlib.metadata as md

        for pkg in ("torch", "mlflow", "ray", "deepspeed"):
            try:
                report[pkg] = md.version(pkg)
            except md.PackageNotFoundError:
                report[pkg] = None
    except Exception:  # pragma: no cover - importlib.metadata is in the standard library
        report["libraries_note"] = "could not read the installed versions"
    rank_env: dict[str, str] | None = None
    note = None
    opts = None
    # what --check fails on: every option variable that cannot be used, not the first alone
    rejected: list[str] = [speak_cli(p) for p in _defaults.env_problems()]
    try:
        opts, sources = _defaults.resolve_with_sources(options_from_args(ns))
        report["options"] = option_rows(opts, sources)
    except DistributedError as exc:
        note = speak_cli(exc)
        if note not in rejected:
            rejected.append(note)
    report["settings"] = setting_rows()
    for var, row in report["settings"].items():
        if "rejected" in row:
            bad = row["rejected"]
            rejected.append(
                f"{var}={bad['value']!r} is rejected ({bad['why']}): "
                f"the built-in {row['value']} is in force"
            )
    if opts is not None and opts.backend == "ray":
        note = "backend ray: LOCAL_RANK, NODE_RANK, MASTER_ADDR and devices are set per node"
    elif opts is not None:
        shown = opts
        if not devs and opts.gpus is None and opts.processes is None:
            # A call here needs --processes N; show what a rank of such a call would see.
            shown = dataclasses.replace(opts, processes=1)
            note = (
                f"no GPU found: a call here needs --processes N (or {contract.option_var('processes')}); "
                "the environment shown is that of --processes 1"
            )
        try:
            plan = plan_local(lambda: None, shown)  # what a call would do; reserves no GPU
            want = plan.gpus_wanted
            devices = plan.devices[:want] if isinstance(want, int) else plan.devices
            env = rank_specs(plan, shown, run_dir="<run dir>", devices=devices)[0].env
            rank_env = {k: redact(env[k]) for k in _SHOWN if k in env}  # never a password
            report["world_size"] = plan.world_size
        except DistributedError as exc:
            note = speak_cli(exc)
    report["rank0_env"] = rank_env
    if note:
        report["note"] = note
    status = 1 if ns.check and rejected else 0
    if status:
        for line in rejected:
            print(f"gangrun info --check: {line}", file=sys.stderr)
    if ns.json:
        print(json.dumps(report, indent=2))
        return status
    print(f"gangrun {report['gangrun']} (python {report['python']}, {report['cpus']} CPUs)")
    libs = ", ".join(f"{k} {report.get(k) or '-'}" for k in ("torch", "mlflow", "ray", "deepspeed"))
    print(f"libraries: {libs}")
    if devs:
        print(f"accelerators ({len(devs)}):")
        for line in accelerators.format_gpu_report(devs, usage, me=getpass.getuser()):
            print(line)
    else:
        print("accelerators: none found (use --processes N for CPU ranks)")
    if "options" in report:
        print("options (value, and where it comes from):")
        rows: list[tuple[str, dict[str, Any]]] = []
        for k, v in report["options"].items():  # an option group: one row per field
            rows += [(f"{k}.{n}", f) for n, f in v["fields"].items()] if "fields" in v else [(k, v)]
        print_rows(rows)
    print("process settings (value, and where it comes from):")
    print_rows(list(report["settings"].items()))
    if rank_env is not None:
        print(f"environment of rank 0 of {report['world_size']}:")
        for k, v in rank_env.items():
            print(f"  {k}={v}")
    if note:
        print(f"note: {note}")
    return status


def _split_run(
    args: list[str], valued: set[str] | None = None
) -> tuple[list[str], list[str], str | None]:
    """``[gangrun options] (script.py | -m module) [its args]`` -> (ours, its, module):
    everything from the script (or after ``-m module``) on belongs to the script.
    ``valued``: the flags that take a value (default: those of the ``run`` parser)."""
    if valued is None:
        valued = _valued_flags(_parsers()[1])
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
            i += 2 if a in valued else 1
            continue
        return args[:i], args[i:], None
    return args, [], None


def _valued_flags(parser: argparse.ArgumentParser) -> set[str]:
    return {
        flag
        for action in parser._actions
        if action.option_strings and action.nargs != 0 and action.dest != "module"
        for flag in action.option_strings
    }


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        top, run_parser, info_parser = _parsers()
        sub = {"run": run_parser, "info": info_parser}.get(args[0]) if args else None
        if sub is not None:
            ours = (
                _split_run(args[1:], _valued_flags(run_parser))[0]
                if sub is run_parser
                else args[1:]
            )
            unknown = unknown_flag(sub, ours)
            if unknown:
                sub.error(unknown)  # the subcommand's usage, exit 2
        if args and args[0] == "run":
            ours, theirs, module = _split_run(args[1:], _valued_flags(run_parser))
            ns = top.parse_args(["run", *ours])
            ns.module = module
            ns.target = theirs
            return cmd_run(ns, run_parser)
        ns = top.parse_args(args)
        if ns.cmd == "run":  # pragma: no cover - handled above
            return cmd_run(ns, run_parser)
        if ns.cmd == "checkpoints":
            from .checkpoints import cmd_checkpoints

            return cmd_checkpoints(ns)
        if ns.cmd != "info":
            from .node import run_node_command

            return run_node_command(ns)
        return cmd_info(ns)
    except SystemExit as exc:  # argparse: --help, --version, usage errors
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
