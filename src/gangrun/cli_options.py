"""The ``gangrun`` command's option flags: one per field of :class:`gangrun.Options`.

Values are parsed as the ``GANGRUN_<OPTION>`` variables are (:mod:`gangrun.defaults`), so a
duration is ``90``, ``90s``, ``15m``, ``2h``, ``1h30m`` or ``none`` on both. A flag that is
not given leaves its option to ``GANGRUN_<OPTION>`` and the built-in default.
"""

from __future__ import annotations

import argparse
import re
from typing import Any

from . import defaults as _defaults

# The tracking options (experiment_name, run_name, run_id, tags) get their flags from the
# tracking module's own section of the CLI.
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


# option -> (flags, add_argument keywords). Booleans get --x/--no-x.
FLAGS: dict[str, tuple[tuple[str, ...], dict[str, Any]]] = {
    "gpus": (
        ("--gpus",),
        {
            "metavar": "N|I,J",
            "help": "ranks, one GPU each: a count, or device indices like 0,3 (default: every GPU)",
        },
    ),
    "processes": (
        ("--processes", "--nproc"),
        {"metavar": "N", "help": "CPU ranks (gloo), no GPU needed"},
    ),
    "gpu_type": (
        ("--gpu-type",),
        {"metavar": "TYPE", "help": "require this accelerator, e.g. H100"},
    ),
    "timeout": (
        ("--timeout",),
        {"metavar": "DURATION", "help": "for the whole run (default 3h); 0 or none: no limit"},
    ),
    "mlflow": (("--mlflow",), {"help": "one MLflow run for the call (default: on)"}),
    "env": (
        ("--env",),
        {"metavar": "KEY=VALUE", "help": "extra environment variable for every rank (repeatable)"},
    ),
    "max_restarts": (
        ("--max-restarts",),
        {"metavar": "N", "help": "relaunch the whole gang up to N times after a failure"},
    ),
    "output": (
        ("--output",),
        {
            "choices": ("all", "rank0", "none"),
            "help": "whose output to show (default all; every rank's log is kept anyway)",
        },
    ),
    "max_capture_bytes": (
        ("--max-capture-bytes",),
        {"metavar": "SIZE", "help": "limit on the pickled script/function (default 1GiB)"},
    ),
    "grace_period": (
        ("--grace-period",),
        {"metavar": "DURATION", "help": "between SIGTERM and SIGKILL when stopping ranks (5s)"},
    ),
    "log_dir": (("--log-dir",), {"metavar": "DIR", "help": "keep every rank's log under DIR"}),
    "start_method": (
        ("--start-method",),
        {
            "choices": ("auto", "spawn", "forkserver"),
            "help": "how ranks start (default auto: a warm fork server when usable)",
        },
    ),
    "backend": (
        ("--backend",),
        {"choices": ("local", "ray"), "help": "this node, or a Ray cluster"},
    ),
    "address": (
        ("--address",),
        {"metavar": "ADDR", "help": "Ray cluster address (backend ray; default RAY_ADDRESS)"},
    ),
    "log_system_metrics": (
        ("--system-metrics",),
        {"help": "log CPU/GPU/memory metrics to the MLflow run (default: off)"},
    ),
    "hang_timeout": (
        ("--hang-timeout",),
        {
            "metavar": "DURATION",
            "help": "stop when a rank makes no progress this long (default: off)",
        },
    ),
    "gpu_wait": (
        ("--gpu-wait",),
        {
            "metavar": "DURATION",
            "help": "wait this long for GPUs busy with another call of "
            "yours (default 0: fail at once; none: no limit)",
        },
    ),
}
_BOOLEAN = ("mlflow", "log_system_metrics")


def add_option_flags(parser: argparse.ArgumentParser) -> None:
    """Add a flag for every option (defaults suppressed: only given flags are set)."""
    world = parser.add_mutually_exclusive_group()
    for option, (flags, kw) in FLAGS.items():
        kw = dict(kw, dest=option, default=argparse.SUPPRESS)
        target = world if option in ("gpus", "processes") else parser
        if option in _BOOLEAN:
            target.add_argument(*flags, action=argparse.BooleanOptionalAction, **kw)
        elif option == "env":
            target.add_argument(*flags, action="append", type=_env_pair, **kw)
        elif "choices" in kw:
            target.add_argument(*flags, **kw)
        else:
            target.add_argument(*flags, type=_typed(option), **kw)


def options_from_args(ns: argparse.Namespace) -> dict[str, Any]:
    """The options given on the command line (the explicit layer of the defaults)."""
    given = {name: getattr(ns, name) for name in _defaults_fields() if hasattr(ns, name)}
    if "env" in given:
        given["env"] = dict(given["env"])
    return given


def _defaults_fields() -> list[str]:
    import dataclasses

    from .api import Options

    return [f.name for f in dataclasses.fields(Options)]


def flag_for(option: str) -> str | None:
    entry = FLAGS.get(option)
    return entry[0][0] if entry else None


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
        spelled = FLAGS[name][0][0]
        if name in _BOOLEAN:
            return spelled if value == "True" else "--no-" + spelled[2:]
        if name == "gpus" and value.startswith("["):
            value = value.strip("[]").replace(" ", "")
        return f"{spelled} {'none' if value == 'None' else value}"

    text = re.sub(rf"(?<![\w.\[])({names})=(\[[^\]]*\]|'[^']*'|\"[^\"]*\"|[^\s,;)]+)", flag, text)
    return text.replace("(None: no limit)", "(none: no limit)")


__all__ = ["FLAGS", "TRACKING_OPTIONS", "add_option_flags", "options_from_args", "speak_cli"]
