"""Interactive gangs: ranks that stay alive across notebook cells (``gangrun.Gang``).

``protocol`` (framing, cell compilation) and ``rank`` (the rank side, ``rank_state()``) import
nothing heavy; ``session`` is the caller's `Gang`; ``magic`` the ``%%distributed`` cell
magic. The gang is one ordinary long-lived call of `rank.gang` whose ranks connect back
to the caller, so launch, output, liveness, teardown and MLflow come from the call machinery.
"""
