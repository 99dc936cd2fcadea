"""Interactive gangs: ranks that stay alive across notebook cells (``gangrun.Gang``).

The rank side lives in `gangrun.rank`: ``interactive_protocol`` (framing, cell compilation)
and ``interactive`` (the rank loop, ``rank_state()``) import nothing heavy. Here:
``session`` is the caller's `Gang`, ``exchange`` one execution, ``channel`` where the ranks
connect back, ``magic`` the ``%%distributed`` cell magic. The gang is one ordinary long-lived
call of `gangrun.rank.interactive.gang` whose ranks connect back
to the caller, so launch, output, liveness, teardown and MLflow come from the call machinery.
"""
