"""The ``gangrun`` command (the ``gangrun`` console script and ``python -m gangrun``).

- ``entry``: the parser and ``main`` (``gangrun run``, ``info``, ``--version``...);
- ``options``: a flag for every option of ``@distributed``;
- ``node``: ``ps``, ``logs``, ``stacks``, ``stop`` over the node's calls;
- ``status``: the live status line of ``gangrun run``;
- ``checkpoints``: ``gangrun checkpoints URL``;
- ``support``: what these share (log paths, writing to a pipe).
"""

from __future__ import annotations

from .entry import main

__all__ = ["main"]
