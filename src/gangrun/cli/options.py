"""The ``gangrun`` command's option flags: one per field of [`gangrun.Options`][gangrun.api.Options].

Values are parsed as the ``GANGRUN_<OPTION>`` variables are (`gangrun.defaults`), so a
duration is ``90``, ``90s``, ``15m``, ``2h``, ``1h30m`` (``1h30`` too) or ``none`` on both. A flag that is
not given leaves its option to ``GANGRUN_<OPTION>`` and the built-in default.
"""

from __future__ import annotations

import argparse
import re
from typing import Any

from .. import defaults as _defaults

# Options whose flags sit in the "MLflow" group of the help (docs/tracking.md).
TRACKING_OPTIONS = ("experiment_name", "run_name", "run_id", "tags")


def _typed(option: str) -> Any:
    def parse(text: str) -> Any:
        try:
            return _defaults.parse_value(option, text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    parse.__name__ = option
    return parse


def _env_pair(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"takes KEY=VALUE, got {text!r}")
    return key, value


_ON_OFF = ("on", "off")
_OUTPUTS = ("all", "rank0", "none")
_METHODS = ("auto", "spawn", "forkserver")
_BACKENDS = ("local", "ray")
# option: (flags, metavar, or choices; or _ON_OFF for --x/--no-x), help.
# fmt: off
_ROWS: dict[str, tuple[tuple[str, ...], Any, str]] = {
    "gpus": (("--gpus",), "N|I,J", "ranks, one GPU each: a count, or device indices like 0,3 (default: every GPU)"),
    "processes": (("--processes", "--nproc"), "N", "CPU ranks (gloo), no GPU needed"),
    "gpu_type": (("--gpu-type",), "TYPE", "require this accelerator, e.g. H100"),
    "timeout": (("--timeout",), "DURATION", "for the whole run (default 3h); 0 or none: no limit"),
    "mlflow": (("--mlflow",), _ON_OFF, "one MLflow run for the call (default: on)"),
    "env": (("--env",), "KEY=VALUE", "extra environment variable for every rank (repeatable)"),
    "max_restarts": (("--max-restarts",), "N", "relaunch the whole gang up to N times after a failure"),
    "min_ranks": (("--min-ranks",), "N", "backend ray: restart after a lost node on the ranks that can still be placed, at least N"),
    "restart_backoff": (("--restart-backoff",), "DURATION", "wait before the first restart, doubled for each next one (default 1s; 0: at once)"),
    "restart_backoff_max": (("--restart-backoff-max",), "DURATION", "the longest wait between two attempts (default 60s)"),
    "output": (("--output",), _OUTPUTS, "whose output to show (default all; every rank's log is kept)"),
    "max_capture_bytes": (("--max-capture-bytes",), "SIZE", "limit on the pickled script/function (default 1GiB)"),
    "grace_period": (("--grace-period",), "DURATION", "between SIGTERM and SIGKILL when stopping ranks (5s)"),
    "log_dir": (("--log-dir",), "DIR", "keep every rank's log under DIR"),
    "start_method": (("--start-method",), _METHODS, "how ranks start (default auto: a warm fork server when usable)"),
    "backend": (("--backend",), _BACKENDS, "this node (default), or a Ray cluster"),
    "address": (("--address",), "ADDR", "Ray cluster address (backend ray; default RAY_ADDRESS)"),
    "ray": (("--ray",), "JSON", 'backend ray: what reaches the nodes and how they are placed (RayOptions), e.g. \'{"ship": false}\', \'{"pip": ["pkg"], "strategy": "SPREAD"}\''),
    "forkserver": (("--forkserver",), "JSON", 'the warm fork server (ForkServerOptions), e.g. \'{"preload": ["torch", "transformers"], "start_timeout": 600}\''),
    "log_system_metrics": (("--system-metrics",), _ON_OFF, "log CPU/GPU/memory metrics to the MLflow run (default: off)"),
    "progress": (("--progress",), _ON_OFF, "in a Jupyter kernel: the live panel of each call (default: on)"),
    "hang_timeout": (("--hang-timeout",), "DURATION", "stop when a rank holds the others in a collective this long (default: auto; 0: off)"),
    "experiment_name": (("--experiment-name",), "NAME", "put the MLflow run in this experiment (created if missing)"),
    "run_name": (("--run-name",), "NAME", "name of the MLflow run (default: the script's name)"),
    "run_id": (("--run-id",), "ID", "resume this MLflow run (same id, metric history continued)"),
    "tags": (("--tag",), "KEY=VALUE", "extra tag on the MLflow run (repeatable)"),
    "checkpoint_dir": (("--checkpoint-dir",), "URL", "where gangrun.Checkpointer keeps the run's checkpoints (directory or fsspec URL)"),
    "memory": (("--memory",), _ON_OFF, "with --checkpoint-dir and --max-restarts: also snapshot the state into shared memory, restored after a restart (default: on)"),
    "memory_every": (("--memory-every",), "N", "snapshot into memory every N steps (default: as often as 3%% of the step time allows)"),
    "gpu_wait": (("--gpu-wait",), "DURATION", "wait this long for GPUs busy with another call of yours (default 0: fail at once; none: no limit)"),
}
# fmt: on
FLAGS: dict[str, tuple[str, ...]] = {option: row[0] for option, row in _ROWS.items()}
_PAIRS = ("env", "tags")  # repeatable KEY=VALUE flags
_BOOLEAN = tuple(o for o, row in _ROWS.items() if row[1] is _ON_OFF)


def add_option_flags(parser: argparse.ArgumentParser) -> None:
    """Add a flag for every option (defaults suppressed: only given flags are set)."""
    world = parser.add_mutually_exclusive_group()
    tracking = parser.add_argument_group("MLflow (see docs/tracking.md)")
    for option, (flags, how, text) in _ROWS.items():
        kw: dict[str, Any] = {"dest": option, "default": argparse.SUPPRESS, "help": text}
        target: Any = parser
        if option in ("gpus", "processes"):
            target = world
        elif option in TRACKING_OPTIONS:
            target = tracking
        if how is _ON_OFF:
            kw["action"] = argparse.BooleanOptionalAction
        elif isinstance(how, tuple):
            kw["choices"] = how
        else:
            kw["metavar"] = how
            kw["type"] = _env_pair if option in _PAIRS else _typed(option)
            if option in _PAIRS:
                kw["action"] = "append"
        target.add_argument(*flags, **kw)


def options_from_args(ns: argparse.Namespace) -> dict[str, Any]:
    """The options given on the command line (the explicit layer of the defaults)."""
    given = {name: getattr(ns, name) for name in _defaults_fields() if hasattr(ns, name)}
    for name in _PAIRS:
        if name in given:
            given[name] = dict(given[name])
    from ..options import ForkServerOptions, RayOptions

    for name, group in (("ray", RayOptions), ("forkserver", ForkServerOptions)):
        if name in given:  # --ray JSON, --forkserver JSON: an option group
            given[name] = group.coerce(given[name])
    return given


def _defaults_fields() -> list[str]:
    import dataclasses

    from ..options import Options

    return [f.name for f in dataclasses.fields(Options)]


def speak_cli(error: BaseException | str) -> str:
    """An error message rephrased for the command line: ``processes=2`` -> ``--processes 2``.

    The Python-facing message is left as is; an error that carries its own ``cli_message``
    attribute is shown with that instead."""
    custom = getattr(error, "cli_message", None)
    if isinstance(custom, str) and custom:
        return custom
    text = str(error)
    text = re.sub(r"@distributed\(([^()]*)\)", r"\1", text)
    names = "|".join(sorted(FLAGS, key=len, reverse=True))

    def flag(m: re.Match[str]) -> str:
        name, value = m.group(1), m.group(2).strip("'\"")
        spelled = FLAGS[name][0]
        if name in _BOOLEAN:
            return spelled if value == "True" else "--no-" + spelled[2:]
        if name == "gpus" and value.startswith("["):
            value = value.strip("[]").replace(" ", "")
        return f"{spelled} {'none' if value == 'None' else value}"

    value = r"(\[[^\]]*\]|'[^']*'|\"[^\"]*\"|[^\s,;)]+(?![^\s,;)]))"
    # ``min_ranks=1 (from GANGRUN_MIN_RANKS)`` was no flag: left as the variable set it
    text = re.sub(rf"(?<![\w.\[])({names})={value}(?! \(from )", flag, text)
    return text.replace("(None: no limit)", "(none: no limit)")


__all__ = ["FLAGS", "TRACKING_OPTIONS", "add_option_flags", "options_from_args", "speak_cli"]
