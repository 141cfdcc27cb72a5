"""The baseline plans ``solve`` offers besides the optimal one (NOTE [ Baselines ]), and the
check that every block offers an option a plan needs. Pure: no torch."""

from __future__ import annotations

import math

from remat.errors import InvalidValue
from remat.plan.chain import ChainConstraints

__all__ = ["baseline", "option_index"]

# NOTE [ Baselines ]
# They are what people do by hand, kept to measure the optimal plan against.
# - none: every block kept, the plain step.
# - all: every block recomputed, what ``gradient_checkpointing_enable()`` does.
# - every_k: recompute blocks k, 2k, ... counting from 1 (indices k-1, 2k-1, ...), the reading of
#   torchtitan's ``selective_ac_option=<k>`` (checkpoint_wrapper on every k-th layer).
# - sqrt: Chen et al. 2016 ("Training Deep Nets with Sublinear Memory Cost") store the inputs of
#   ~sqrt(n) segments and hold one segment's sqrt(n) blocks of activations while recomputing it.
#   Per-block options cannot drop a recomputed block's input, so the faithful per-block reading
#   spends the same sqrt(n) blocks of activations on keeping isqrt(n) evenly spaced blocks whole
#   (centres of isqrt(n) equal stretches) and recomputes every other block.


def baseline(method: str, chain: ChainConstraints, n: int, k: int | None) -> list[str]:
    if method == "none":
        option_index(chain, "keep")
        return ["keep"] * n
    option_index(chain, "recompute")
    if method == "all":
        return ["recompute"] * n
    if method == "every_k":
        k = 2 if k is None else k
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise InvalidValue(f"k must be an int >= 1 (recompute every k-th block), got {k!r}")
        return ["recompute" if (i + 1) % k == 0 else "keep" for i in range(n)]
    assert method == "sqrt", method
    option_index(chain, "keep")
    stretches = math.isqrt(n)
    whole = {int((j + 0.5) * n / stretches) for j in range(stretches)}
    return ["keep" if i in whole else "recompute" for i in range(n)]


def option_index(chain: ChainConstraints, option: str) -> int:
    if option not in chain.options:
        raise InvalidValue(
            f"this plan needs option {option!r}, which not every block of the profile offers; "
            f"the blocks offer {list(chain.options)} in common; re-profile with {option!r} enabled"
        )
    return chain.options.index(option)
