"""What a part needs is given to it when it is made, and read through its type.

Read with ``ast`` over ``src/gangrun``: no module looks the command line's module up in
``sys.modules`` to learn what made a call (the call is told: `Wiring`'s ``caller``), and
``getattr(obj, "name")`` with a literal name is only for objects gangrun does not type:
the user's callables and datasets, other libraries' objects (IPython, torch, MLflow,
pynvml, fsspec), streams and exceptions from anywhere. Each such use is listed below with
why; a new one on a typed object (``getattr(gang, "spawner", None)``) fails the test: give
the type the member, or hand the value over when the reader is made.
"""

from __future__ import annotations

import ast

from test_layers import MODULES

_USER_CALLABLE = "a user's callable: any object"
_TORCH_LOADER = "torch's DataLoader and the user's samplers: whatever the user built"
_USER_STATE = "the user's state entries: modules, optimizers, loaders, any object"
_IPYTHON = "IPython's shell: its attributes vary with the version and the frontend"
_STREAM = "a text stream given by the user or the frontend: any object with write()"
_PENDING = "reworked by another change (the Checkpointer split, the data split)"

# (module, attribute) -> why a getattr with a literal name is right there
UNTYPED: dict[tuple[str, str], str] = {
    ("gangrun._log", "_gangrun"): "a mark on logging handlers, which may be anyone's",
    ("gangrun.output", "name"): "a log file object: whatever opened it, maybe no name",
    ("gangrun.api", "__qualname__"): _USER_CALLABLE,
    ("gangrun.checks", "__qualname__"): _USER_CALLABLE,
    ("gangrun.wire.serialization", "__qualname__"): _USER_CALLABLE,
    ("gangrun.interactive.session", "__qualname__"): _USER_CALLABLE,
    ("gangrun.lifecycle.plan", "__qualname__"): _USER_CALLABLE,
    ("gangrun.lifecycle.plan", "__name__"): _USER_CALLABLE,
    ("gangrun.rank.source", "__qualname__"): _USER_CALLABLE,
    ("gangrun.rank.source", "__module__"): "any object a notebook cell defined",
    ("gangrun.rank.source", "co_qualname"): "code objects have it from Python 3.11 on",
    ("gangrun.data.dataset", "__qualname__"): "the user's decode function: any callable",
    ("gangrun.lifecycle.record", "source_file"): (
        "the called object: a user's function, or `gangrun run`'s target naming its file"
    ),
    ("gangrun.cli.options", "cli_message"): "any error may carry its command-line wording",
    ("gangrun.lifecycle.hang", "read_chars"): "psutil's io counters: Linux has it, not all",
    ("gangrun.lifecycle.hang", "write_chars"): "psutil's io counters: Linux has it, not all",
    **{
        ("gangrun.rank.collectives", name): "torch's modules and classes, whichever version "
        "is installed (the record must never break a call)"
        for name in (
            "__file__",
            "traceable_collective_remaps",
            "compiler",
            "is_compiling",
            "distributed_c10d",
            "DistributedDataParallel",
            "forward",
            "Tensor",
            "autograd",
            "backward",
        )
    },
    ("gangrun.rank.collectives", "__wrapped__"): "a function functools.wraps made, or not",
    ("gangrun.rank.flight", "_dump_nccl_trace"): "torch's CUDA builds only",
    ("gangrun.rank.flight", "_dump_fr_trace"): "torch's newer builds only",
    ("gangrun.data.listing", "O_CLOEXEC"): "a platform constant",
    ("gangrun.data.cache", "F_OFD_SETLKW"): "a platform constant (Linux only)",
    ("gangrun.data.loader", "ds"): _PENDING,
    (
        "gangrun.data.loader",
        "held",
    ): "any Resumable dataset (a user's too); only gangrun's hold a global batch",
    (
        "gangrun.data.loader",
        "held_join",
    ): "any Resumable dataset (a user's too); only gangrun's hold a global batch",
    (
        "gangrun.data.table.held",
        "close",
    ): "the chunks' iterator: a generator has close(), a list has not",
    ("gangrun.data.loader", "seed"): "the user's dataset",
    ("gangrun.data.table.loader", "_shutdown_workers"): "torch's DataLoader iterator",
    ("gangrun.data.table.source", "close"): "the user's iterable of paths",
    ("gangrun.rank.interactive", "encoding"): _STREAM,
    ("gangrun.rank.interactive", "errors"): _STREAM,
    ("gangrun.rank.forkchild", "encoding"): _STREAM,
    ("gangrun.rank.forkchild", "errors"): _STREAM,
    ("gangrun.rank.checkpointer", "url"): _PENDING,
    ("gangrun.checkpoint.volume", "upload_completion"): "torch's async save result, by version",
    ("gangrun.rank.tracking", "flush_async_logging"): "MLflow has it in some versions",
    ("gangrun.rank.stop", "_set_worker_signal_handlers"): "torch's private hook, by version",
    ("gangrun.rank.stop", "gangrun_guard"): "a mark on torch's hook (ours or not)",
    ("gangrun.tracking.plan", "error_code"): "MLflow's exceptions, by version",
    ("gangrun.tracking.bounded", "reason"): "any exception of the HTTP stack",
    ("gangrun.checkpoint", "dircache"): "an fsspec file system: some have a cache",
    ("gangrun.checkpoint.manifest", "fqn"): "torch's DCP write items, by version",
    ("gangrun.checkpoint.state", "state_dict"): _USER_STATE,
    ("gangrun.checkpoint.state", "load_state_dict"): _USER_STATE,
    ("gangrun.checkpoint.state", "volume"): _USER_STATE,
    ("gangrun.checkpoint.state", "ds"): _USER_STATE,
    ("gangrun.checkpoint.state", "resume_summary"): _USER_STATE,
    ("gangrun.checkpoint.state", "DistributedSampler"): (
        "gangrun's sampler class when its module is loaded: a user who never imported it has none"
    ),
    ("gangrun.checkpoint.dataloader", "batch_sampler"): _TORCH_LOADER,
    ("gangrun.checkpoint.dataloader", "sampler"): _TORCH_LOADER,
    ("gangrun.checkpoint.dataloader", "generator"): _TORCH_LOADER,
    ("gangrun.checkpoint.dataloader", "batch_size"): _TORCH_LOADER,
    ("gangrun.checkpoint.dataloader", "_gangrun_base"): "a mark on the user's loader classes",
    ("gangrun.checkpoint.dataloader", "state_dict"): _TORCH_LOADER,
    ("gangrun.host.accelerators", "usedGpuMemory"): "pynvml's process records, by version",
    ("gangrun.wire.diskfull", "strerror"): "any exception a write raised",
    ("gangrun.launch.ray.diagnose", "name"): "any exception Ray raised",
    ("gangrun.launch.ray.diagnose", "filename"): "any exception Ray raised",
    ("gangrun.launch.ray.ship", "__file__"): "any module in sys.modules",
    ("gangrun.notebook", "kernel"): _IPYTHON,
    ("gangrun.notebook.panel", "display_pub"): _IPYTHON,
    ("gangrun.notebook.session", "display_pub"): _IPYTHON,
    ("gangrun.notebook.resumed", "run_dir"): _PENDING + " (the module goes)",
    ("gangrun.notebook.resumed", "world_size"): _PENDING + " (the module goes)",
}


def _trees() -> dict[str, ast.Module]:
    return {m: ast.parse(p.read_text(), str(p)) for m, p in MODULES.items()}


TREES = _trees()


def literal_getattrs(tree: ast.AST) -> list[tuple[int, str]]:
    """``getattr(obj, "name"[, default])`` calls: (line, name)."""
    return [
        (node.lineno, node.args[1].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "getattr"
        and len(node.args) >= 2
        and isinstance(node.args[1], ast.Constant)
        and isinstance(node.args[1].value, str)
    ]


def test_getattr_with_a_literal_name_only_on_untyped_objects():
    found = [
        f"{MODULES[m]}:{line}: getattr(..., {name!r})"
        for m, tree in TREES.items()
        for line, name in literal_getattrs(tree)
        if (m, name) not in UNTYPED
    ]
    assert not found, (
        "getattr with a literal name on an object gangrun types: read it through the type, "
        "or give it when the reader is made (else list it in UNTYPED with why):\n"
        + "\n".join(found)
    )


def test_the_check_sees_getattr_with_a_literal_name():
    tree = ast.parse(
        'a = getattr(gang, "spawner", None)\nb = getattr(x, name)\nc = getattr(y, "z")\n'
    )
    assert literal_getattrs(tree) == [(1, "spawner"), (3, "z")]


def test_no_module_asks_the_command_line_what_made_a_call():
    # `gangrun run` says so when it makes the call (Wiring's caller); nothing looks its module
    # up in sys.modules (the layer test reads such look-ups as imports, too).
    found = []
    for m, tree in TREES.items():
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and node.value.startswith("gangrun.cli")
                and not m.startswith("gangrun.cli")
            ):
                found.append(f"{MODULES[m]}:{node.lineno}: {node.value!r}")
    assert not found, "modules naming the command line's modules:\n" + "\n".join(found)
