"""What DDP, FSDP and DeepSpeed need inside a gangrun rank: the public import path of
`gangrun.rank.frameworks` (the code runs inside ranks, so it lives on the rank side)."""

from __future__ import annotations

from ..rank.frameworks import deepspeed_env, deepspeed_setup, seed_everything

__all__ = ["deepspeed_env", "deepspeed_setup", "seed_everything"]
