"""The rank side: every module that runs inside a rank process.

A rank (a fresh interpreter, a child of the fork server, a Ray rank) imports only this package
and the platform helpers (the formats of `gangrun.wire`: records, rundir, contract...), never
the API, the lifecycle or the launchers (`tests/unit/test_layers.py`). The caller side may
import it: the step-report and stack-dump readers sit next to their writers, and the
interactive gang's framing is shared by both ends.

- `boot`: a fresh-interpreter rank's entry point; every rank becomes the subreaper of its
  descendants.
- `forkchild`: a child of the fork server becoming a rank.
- `worker`: the rank's main: the caller's liveness, the payload, the result or error record.
- `heartbeat`, `progress`, `stacks`: ``gangrun.heartbeat()``, ``gangrun.report_step()`` and
  the stack dump on ``SIGUSR1`` (with their caller-side readers).
- `tracking`: ends the MLflow runs a rank opened.
- `checkpointer`, `stop`: ``gangrun.Checkpointer`` and ``gangrun.should_stop()``.
- `interactive`, `interactive_protocol`: a gang's rank loop (``gangrun.rank_state()``) and the
  framing both ends speak.
- `source`: the user's notebook source, travelling with the payload (unpickled in the rank).

Importing this package imports nothing: the fork server preloads the modules it names.
"""
