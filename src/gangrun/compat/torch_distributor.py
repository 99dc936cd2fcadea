"""``pyspark.ml.torch.distributor.TorchDistributor`` without Spark.

Code written for Spark's distributor runs unchanged on one node::

    from gangrun.compat import TorchDistributor          # was: from pyspark.ml.torch.distributor
    model = TorchDistributor(num_processes=2, local_mode=True, use_gpu=False).run(train, 1e-3)

As with Spark, ``run(fn, *args, **kwargs)`` returns rank 0's return value and
``run("train.py", *cli_args)`` runs the script on every rank and returns ``None``. Each rank
sees torchrun's environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``...),
so ``init_process_group()`` with no arguments works as under Spark. ``use_gpu=True`` gives
one GPU per process; ``use_gpu=False`` gives CPU processes (gloo).

``local_mode=False`` (ranks spread over Spark executors) needs a cluster: pass
``backend="ray"`` (and ``address=`` unless ``RAY_ADDRESS`` is set) and the processes are
placed on the Ray cluster instead. Any other ``@distributed`` option (``timeout``, ``env``,
``mlflow``, ``output``...) may be passed as a keyword argument.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..errors import LaunchError


class TorchDistributor:
    def __init__(
        self,
        num_processes: int = 1,
        local_mode: bool = True,
        use_gpu: bool = True,
        _ssl_conf: Any = None,
        **options: Any,
    ) -> None:
        if isinstance(num_processes, bool) or not isinstance(num_processes, int):
            raise LaunchError(f"num_processes must be an integer, got {num_processes!r}.")
        if num_processes < 1:
            raise LaunchError(f"num_processes must be >= 1, got {num_processes}.")
        backend = options.get("backend", "local")
        if not local_mode and backend != "ray":
            raise LaunchError(
                "TorchDistributor(local_mode=False) spreads the processes over a cluster's "
                "executors; without Spark, gangrun does that on a Ray cluster: pass "
                "backend='ray' (and address='host:6379' unless RAY_ADDRESS is set). On one "
                "node, use local_mode=True."
            )
        if local_mode and backend == "ray":
            raise LaunchError(
                "backend='ray' places processes on a cluster: use it with local_mode=False."
            )
        from ..api import Options

        fields: dict[str, Any] = (
            {"gpus": num_processes} if use_gpu else {"processes": num_processes}
        )
        unknown = set(options) - set(Options.__dataclass_fields__)
        if unknown:
            raise LaunchError(f"unknown option(s): {', '.join(sorted(unknown))}")
        clash = set(options) & {"gpus", "processes"}
        if clash:
            raise LaunchError(
                f"{', '.join(sorted(clash))}: use num_processes= and use_gpu= instead."
            )
        self.num_processes = num_processes
        self.local_mode = local_mode
        self.use_gpu = use_gpu
        self.options = Options(**fields, **options).validate()

    def run(self, train_object: Callable[..., Any] | str, *args: Any, **kwargs: Any) -> Any:
        """Run ``train_object`` on every process; rank 0's return value (``None`` for a
        script). A failure raises [`gangrun.DistributedError`][gangrun.errors.DistributedError] (a ``RuntimeError``)."""
        from ..api import DistributedFunction

        if isinstance(train_object, str):
            if kwargs:
                raise LaunchError("a script takes command-line arguments (*args), not kwargs.")
            from ..cli.entry import ScriptTarget

            if not train_object.endswith(".py"):
                raise LaunchError(f"expected a path to a .py script, got {train_object!r}.")
            target: Callable[..., Any] = ScriptTarget(train_object, [str(a) for a in args])
            DistributedFunction(target, self.options).distributed()
            return None
        if not callable(train_object):
            raise LaunchError(
                f"run() takes a function or a script path, got {type(train_object).__name__}."
            )
        results = DistributedFunction(train_object, self.options).distributed(*args, **kwargs)
        return results[0]

    def __repr__(self) -> str:
        return (
            f"TorchDistributor(num_processes={self.num_processes}, "
            f"local_mode={self.local_mode}, use_gpu={self.use_gpu})"
        )


__all__ = ["TorchDistributor"]
