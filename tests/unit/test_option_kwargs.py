"""`OptionKwargs` (the typed keywords of ``@distributed`` / ``.options``) matches `Options`:
the same keys, and each keyword's type is the field's."""

from __future__ import annotations

import dataclasses
import inspect
import typing
from collections.abc import Mapping
from typing import Any

from gangrun.api import DistributedFunction, distributed
from gangrun.option_kwargs import OptionKwargs
from gangrun.options import ForkServerOptions, Options, RayOptions

# Keywords that accept more than the field stores (validated, then normalised).
WIDER: dict[str, Any] = {
    "env": Mapping[str, str] | None,  # None: no extra variables
    "tags": Mapping[str, str] | None,  # None: no tags
    "ray": RayOptions | Mapping[str, Any],  # a dict of RayOptions' fields
    "forkserver": ForkServerOptions | Mapping[str, Any],  # a dict of its fields
    # durations: seconds, or text as GANGRUN_TIMEOUT and --timeout take it ("10m")
    "timeout": float | str | None,
    "grace_period": float | str,
    "hang_timeout": float | str | None,
    "gpu_wait": float | str | None,
    "restart_backoff": float | str,
    "restart_backoff_max": float | str,
}


def test_the_keys_are_the_fields_of_options() -> None:
    assert list(OptionKwargs.__annotations__) == [f.name for f in dataclasses.fields(Options)]
    assert OptionKwargs.__required_keys__ == frozenset()  # every option may be left out


def test_each_keyword_has_its_fields_type() -> None:
    fields = typing.get_type_hints(Options)
    keywords = typing.get_type_hints(OptionKwargs)
    for name, kind in fields.items():
        want = WIDER.get(name, kind)
        assert keywords[name] == want, f"{name}: OptionKwargs says {keywords[name]}, want {want}"
    for name in WIDER:  # each widening still accepts the field's own type
        wide = set(typing.get_args(WIDER[name]))
        assert fields[name] in wide or set(typing.get_args(fields[name])) <= wide, name


def test_the_signatures_unpack_it() -> None:
    """``@distributed(...)`` and ``.options(...)`` take ``**options: Unpack[OptionKwargs]``."""
    overloads = typing.get_overloads(distributed)
    for fn in (DistributedFunction.options, distributed, overloads[-1]):
        params = inspect.signature(fn).parameters.values()
        var_kw = [p for p in params if p.kind is inspect.Parameter.VAR_KEYWORD]
        assert [p.annotation for p in var_kw] == ["Unpack[OptionKwargs]"], fn
