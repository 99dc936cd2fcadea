"""Defaults outside code: ``GANGRUN_<OPTION>`` variables and ``gangrun.set_defaults()``.

Every option of ``@distributed`` (every field of [`gangrun.Options`][gangrun.api.Options]) is taken from the
first of these that sets it, at call time (``submit()``/``.distributed()``):

1. an argument given explicitly: to ``@distributed(...)``, a ``gangrun run`` flag, or through
   ``.options(...)`` (which replaces the decorator's value in the copy it returns);
2. ``gangrun.set_defaults(...)`` of this session (process);
3. the environment variable ``GANGRUN_<OPTION>`` (the field name in upper case);
4. gangrun's built-in default.

Each option is taken whole from one layer (an ``env`` dict is not merged across layers).
``gpus`` and ``processes`` count as one choice: a layer that sets either hides both in the
layers below it.
"""

from __future__ import annotations

import dataclasses
import os
import re
import threading
from collections.abc import Iterable, Mapping
from typing import Any

from .durations import parse_duration
from .errors import LaunchError
from .options import AUTO, GROUPS, ZERO_IS_NONE  # 0 means "no limit" for timeout, hang_timeout
from .wire.contract import RUN_ID, option_var

# Option names whose GANGRUN_ variable means something else inside gangrun's own processes:
# never read as an option default. GANGRUN_RUN_ID is the per-call id every rank sees.
NOT_FROM_ENV = {"run_id": f"{RUN_ID} is gangrun's own call id inside ranks; use MLFLOW_RUN_ID"}
_WORLD = frozenset({"gpus", "processes"})
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})
_SIZE = re.compile(r"^(?P<n>\d+(?:\.\d*)?)\s*(?P<u>[kmgt]?)(?:i?b)?$")
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}

_lock = threading.Lock()
_session: dict[str, Any] = {}


# ------------------------------------------------------------------------------ parsing
def parse_size(text: str) -> int | None:
    """``"1048576"``, ``"512MiB"``, ``"2G"`` -> bytes; ``"none"`` -> ``None``."""
    t = str(text).strip().lower()
    if t in ("none", "null"):
        return None
    m = _SIZE.match(t)
    if m is None:
        raise ValueError(f"{text!r} is not a size: give bytes (1048576), or 512MiB, 2GiB, or none")
    return int(float(m.group("n")) * _UNITS[m.group("u")])


def parse_bool(text: str) -> bool:
    t = str(text).strip().lower()
    if t in _TRUE:
        return True
    if t in _FALSE:
        return False
    raise ValueError(f"{text!r} is not a boolean: give 1/0, true/false or yes/no")


def parse_gpus(text: str) -> int | list[int] | None:
    """``"2"`` -> 2 GPUs; ``"0,3"`` or ``"[0, 3]"`` -> those device indices; ``"none"``."""
    t = str(text).strip().lower()
    if t in ("none", "all", ""):
        return None
    is_list = t.startswith("[") or "," in t
    items = [x.strip() for x in t.strip("[]").split(",") if x.strip()]
    try:
        values = [int(x) for x in items]
    except ValueError:
        raise ValueError(
            f"{text!r} is not a GPU count (2) or a list of device indices (0,3)"
        ) from None
    if not is_list and len(values) == 1:
        return values[0]
    return values


def _kind(name: str, annotation: str) -> str:
    if name == "gpus":
        return "gpus"
    if name == "max_capture_bytes":
        return "size"
    a = annotation.replace(" ", "")
    if a.startswith("Literal"):
        return "choice"
    if "Mapping" in a or "dict" in a or a.startswith(("RayOptions", "ForkServerOptions")):
        return "json"
    if a.startswith("bool"):
        return "bool"
    if "float" in a:
        return "duration"
    if "int" in a:
        return "int"
    return "str"


def _nullable(annotation: str) -> bool:
    return "None" in annotation


def parse_value(name: str, text: str) -> Any:
    """The value of option ``name`` written as text (an environment variable, a CLI flag).

    Raises ``ValueError`` with a message saying what was expected."""
    field = _fields()[name]
    ann = str(field.type)
    kind = _kind(name, ann)
    t = str(text).strip()
    special = kind in ("choice", "duration", "size", "gpus")
    if not special and _nullable(ann) and t.lower() in ("none", "null"):
        return None
    if kind == "gpus":
        return parse_gpus(t)
    if kind == "size":
        return parse_size(t)
    if kind == "bool":
        return parse_bool(t)
    if kind == "duration":
        if name in AUTO and t.lower() == "auto":
            return "auto"
        value = parse_duration(t)
        if value is None and not _nullable(ann):
            raise ValueError(f"{name} cannot be none, give a duration like 90s or 5m")
        if value == 0 and name in ZERO_IS_NONE:
            return None
        return value
    if kind == "int":
        try:
            return int(t)
        except ValueError:
            raise ValueError(f"{text!r} is not an integer") from None
    if kind == "json":
        import json

        try:
            value = json.loads(t)
        except ValueError as exc:
            raise ValueError(f'{text!r} is not JSON like {{"KEY": "value"}} ({exc})') from None
        if value is not None and not isinstance(value, dict):
            raise ValueError(f'{text!r} is not a JSON object like {{"KEY": "value"}}')
        return value
    return t  # str, choice: checked by Options.validate


# ------------------------------------------------------------------------------- names
def _fields() -> dict[str, dataclasses.Field]:
    from .options import Options

    return {f.name: f for f in dataclasses.fields(Options)}


def env_var(name: str) -> str:
    """The environment variable that defaults option ``name``: ``GANGRUN_<NAME>``."""
    return option_var(name)


def check_names(names: Iterable[str], what: str) -> None:
    """``LaunchError`` for names that are not options, suggesting the closest valid one."""
    valid = sorted(_fields())
    unknown = [n for n in names if n not in valid]
    if not unknown:
        return
    import difflib  # only on the error path: import gangrun stays light

    parts = []
    for n in sorted(unknown):
        close = difflib.get_close_matches(n, valid, n=1, cutoff=0.5)
        if not close and n.replace("num_", "").rstrip("s") + "s" in valid:
            close = [n.replace("num_", "").rstrip("s") + "s"]
        parts.append(f"{n!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    raise LaunchError(f"unknown {what}(s): {', '.join(parts)}. Valid options: {', '.join(valid)}.")


# -------------------------------------------------------------------------------- layers
def _check_one(name: str, value: Any, where: str) -> None:
    from .options import Options

    try:
        Options(**{name: value}).validate()
    except LaunchError as exc:
        raise LaunchError(f"{where}: {exc}") from None


def from_env(
    environ: Mapping[str, str] | None = None, problems: list[str] | None = None
) -> dict[str, Any]:
    """The option defaults set by ``GANGRUN_<OPTION>`` variables, parsed and checked: a
    `LaunchError` naming the first that cannot be used, or, given ``problems``, each one's
    message appended there (that variable left out)."""
    env = os.environ if environ is None else environ
    out: dict[str, Any] = {}
    for name in _fields():
        var = env_var(name)
        if name in NOT_FROM_ENV or var not in env:
            continue
        raw = env[var]
        try:
            try:
                value = parse_value(name, raw)
            except ValueError as exc:
                raise LaunchError(f"{var}={raw!r}: {exc}.") from None
            if name == "env" and value is None:
                value = {}
            _check_one(name, value, f"{var}={raw!r}")
        except LaunchError as exc:
            if problems is None:
                raise
            problems.append(str(exc))
            continue
        out[name] = value
    if out.keys() >= _WORLD and None not in (out["gpus"], out["processes"]):
        both = f"{env_var('gpus')} and {env_var('processes')} are both set; unset one of them."
        if problems is None:
            raise LaunchError(both)
        problems.append(both)
    return out


def env_problems(environ: Mapping[str, str] | None = None) -> list[str]:
    """Why each ``GANGRUN_<OPTION>`` variable, and each variable of an option group's
    setting (``GANGRUN_RAY_STRATEGY``...), that is set cannot be used: every one, not the
    first alone (`gangrun info --check` names each)."""
    from .options import GROUPS, Options, settings_of

    env = os.environ if environ is None else environ
    problems: list[str] = []
    from_env(env, problems)
    for g in GROUPS:
        group = getattr(Options().validate(), g)
        for field, meta in settings_of(group).items():
            var = meta["env"]
            if var not in env:
                continue
            try:
                value = parse_setting(var, meta["kind"], env[var])
                dataclasses.replace(group, **{field: value}).validate()
            except LaunchError as exc:
                problems.append(str(exc) if var in str(exc) else f"{var}: {exc}")
    return problems


def set_defaults(**options: Any) -> dict[str, Any]:
    """Default options for every call of this session (process), below explicit arguments
    and above ``GANGRUN_<OPTION>`` variables. Each call replaces the previous session
    defaults; ``set_defaults()`` with no arguments returns to the built-in defaults.

    Returns the session defaults now in force. Raises [`gangrun.LaunchError`][gangrun.errors.LaunchError] for an
    unknown name (suggesting the closest valid one) or a bad value.

    >>> gangrun.set_defaults(processes=2, timeout=600, mlflow=False)
    """
    check_names(options, "set_defaults option")
    if options.get("env", {}) is None:
        options["env"] = {}
    if None not in (options.get("gpus"), options.get("processes")):
        raise LaunchError("set_defaults: pass either gpus= or processes=, not both.")
    for name, value in options.items():
        _check_one(name, value, "set_defaults")
    with _lock:
        _session.clear()
        _session.update(options)
        return dict(_session)


def reset_defaults() -> None:
    """Forget the session defaults of [`set_defaults`][gangrun.defaults.set_defaults] (same as ``set_defaults()``)."""
    with _lock:
        _session.clear()


def session_defaults() -> dict[str, Any]:
    with _lock:
        return dict(_session)


def resolve(explicit: Mapping[str, Any], environ: Mapping[str, str] | None = None) -> Any:
    """The validated [`gangrun.Options`][gangrun.api.Options] for ``explicit`` arguments (see the module)."""
    return resolve_with_sources(explicit, environ)[0]


def resolve_with_sources(
    explicit: Mapping[str, Any], environ: Mapping[str, str] | None = None
) -> tuple[Any, dict[str, str]]:
    """Like `resolve`, and where each option came from: ``"argument"``,
    ``"set_defaults"``, ``"env GANGRUN_<OPTION>"`` or ``"built-in"``."""
    from .options import Options

    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    layers = (
        ("argument", explicit),
        ("set_defaults", session_defaults()),
        ("env", from_env(environ)),
    )
    for label, layer in layers:
        world_taken = bool(_WORLD & values.keys())
        for name, value in layer.items():
            if name in values or (name in _WORLD and world_taken):
                continue
            values[name] = value
            sources[name] = f"env {env_var(name)}" if label == "env" else label
    for name in _fields():
        sources.setdefault(name, "built-in")
    opts = Options(**values).validate()
    env = os.environ if environ is None else environ
    groups = {g: _resolve_group(getattr(opts, g), g, sources, opts.env, env) for g in GROUPS}
    return dataclasses.replace(opts, **groups), sources


def name_sources(exc: BaseException, opts: Any, sources: Mapping[str, str]) -> None:
    """Say, in refusal ``exc`` (its message changed in place), where each option it names
    with its value came from when that is not an argument of the call: ``min_ranks=1 (from
    GANGRUN_MIN_RANKS)``, ``(from set_defaults)``. An argument (the decorator's,
    ``.options()``'s, a flag: `speak_cli` spells it as the flag) is named as it was written."""
    if not exc.args or not isinstance(exc.args[0], str):
        return
    text = exc.args[0]
    for name, source in sources.items():
        where = source[len("env ") :] if source.startswith("env ") else source
        if "." in name or where not in ("set_defaults", env_var(name)):
            continue
        value = getattr(opts, name, None)
        written = {str(value), repr(value)}
        if isinstance(value, float):
            written.add(f"{value:g}")  # timeout=600, as messages write seconds
        for m in re.finditer(
            rf"(?<![\w.\[]){name}=(\[[^\]]*\]|'[^']*'|\"[^\"]*\"|[^\s,;)]+)", text
        ):
            shown = m.group(1).rstrip(".:")
            if shown in written:  # the refused value, not advice (``pass max_restarts=N``)
                end = m.start(1) + len(shown)
                text = f"{text[:end]} (from {where}){text[end:]}"
                break
    exc.args = (text, *exc.args[1:])


# ------------------------------------------------------------------------- option groups
def parse_setting(var: str, kind: str, text: str) -> Any:
    """The value of a group field's variable ``var`` (``kind`` from its field's metadata);
    ``LaunchError`` naming the variable for a bad one."""
    t = str(text).strip()
    try:
        if kind == "duration":
            seconds = parse_duration(t)
            if seconds is None or seconds <= 0:
                raise ValueError("give a positive duration like 90s or 5m")
            return seconds
        if kind == "names" or kind == "modules":
            if kind == "modules" and t.lower() in ("", "none", "0", "false"):
                return ()
            return tuple(x.strip() for x in t.split(",") if x.strip())
        if kind == "json":
            import json

            value = json.loads(t) if t else {}
            if not isinstance(value, dict):
                raise ValueError("give a JSON object")
            return value
    except ValueError as exc:
        raise LaunchError(f"{var}={text!r}: {exc}.") from None
    return t


def _resolve_group(
    group: Any,
    name: str,
    sources: dict[str, str],
    call_env: Mapping[str, str],
    environ: Mapping[str, str],
) -> Any:
    """``group`` with every unset field taken from its variable (in the call's ``env``
    option, then the environment) or its built-in default; each field's source goes into
    ``sources`` as ``"<group>.<field>"``."""
    from .options import settings_of

    given = sources[name]
    found: dict[str, Any] = {}
    for field, meta in settings_of(group).items():
        key, var = f"{name}.{field}", meta["env"]
        if getattr(group, field) is not None:
            sources[key] = given
        elif var in call_env:
            found[field] = parse_setting(var, meta["kind"], call_env[var])
            sources[key] = f"env option {var}"
        elif var in environ:
            found[field] = parse_setting(var, meta["kind"], environ[var])
            sources[key] = f"env {var}"
        else:
            sources[key] = "built-in"
    try:
        group = dataclasses.replace(group, **found).validate() if found else group
    except LaunchError as exc:
        where = ", ".join(f"{settings_of(group)[f]['env']}" for f in found)
        raise LaunchError(f"{where}: {exc}") from None
    return group.with_builtins()


__all__ = [
    "set_defaults",
    "reset_defaults",
    "session_defaults",
    "resolve",
    "resolve_with_sources",
    "from_env",
    "env_problems",
    "name_sources",
    "env_var",
    "check_names",
    "parse_value",
    "parse_duration",
    "parse_size",
    "parse_bool",
    "parse_gpus",
    "parse_setting",
]
