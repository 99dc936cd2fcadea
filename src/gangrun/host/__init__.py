"""What this machine has: its processes and directories (``system``), its accelerators
(``accelerators``: detection, device choice, the distributed backend), the per-user
reservation of devices across concurrent calls (``reservation``), the host-wide writer lock
(``lock``), how much room a disk has (``diskspace``) and the sweep of this user's run
directories left by callers that are gone (``system.reap_stale``).

The platform helpers every layer may use; they import no other part of gangrun except the
formats (``wire``) and ``errors``, and nothing here imports torch, mlflow or ray at import
time.
"""
