"""What this machine has: its processes and directories (``system``), its accelerators
(``accelerators``: detection, device choice, the distributed backend), the per-user
reservation of devices across concurrent calls (``reservation``), the host-wide writer lock
(``lock``) and full-disk detection (``diskspace``).

The platform helpers every layer may use; they import no other part of gangrun except
``errors``, and nothing here imports torch, mlflow or ray at import time.
"""
