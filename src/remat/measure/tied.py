"""Profiling again with every call of a tied module checkpointed, where no plan fits without.

# NOTE [ Every call of a tied module ]
A module the model runs more than once per step (a weight-tied layer: ALBERT's shared layer,
perceiver-pytorch's ``weight_tie_layers``) is no block, and is kept (rule 6 of NOTE [ Blocks by
what runs ] in ``remat.manual.settle``): the cost model replays each block once. Its activations
are most of such a model's, and torch's checkpoint on it drops them. So:
1. A profile made with a budget that no plan fits with those modules kept (the refusal names them:
   ``InfeasibleBudget.repeated``, from ``Profile.repeated``) is made again, for the same budget and
   by the same rules, with every call of each of them checkpointed (the option ``recompute``):
   the profile of that step, planned around them as around a user's ``checkpoint_module``.
2. Only then: where a plan fits with them kept, recomputing the module on every call is more than
   the budget needs (ALBERT's shared layer is its whole encoder). All of them or none.
3. The profile names them (``Profile.tied``), and so do its plans (``Plan.tied``): ``apply`` sets
   their option as a block's, ``remove`` takes it off. Profiling leaves the model as it was.
4. That profile's plain step is the step with them checkpointed: a plan's overhead is counted from
   it and leaves out their own recompute (the plan's note says so), since the step with them kept
   does not fit the budget and cannot be timed. That step never runs (``Profile.plain_ran`` is
   False), so ``verify`` does not run it either.
5. Blocks the user names (``blocks=``) leave the rest of the model to the user: nothing is tied.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

from torch import nn

from remat.errors import InfeasibleBudget
from remat.manual.options import clear_option, set_option
from remat.records import Profile

__all__ = ["every_call_checkpointed"]

log = logging.getLogger(__name__)


def every_call_checkpointed(model: nn.Module, refused: InfeasibleBudget,
                            profile_again: Callable[[int], Profile]) -> Profile:
    """The profile of ``model`` with every call of ``refused.repeated`` checkpointed, made by
    ``profile_again(budget_bytes)`` for the budget ``refused`` refused (NOTE [ Every call of a tied
    module ]); the modules' own forwards are put back after, whatever happens."""
    modules = dict(model.named_modules())
    names = list(refused.repeated)
    log.info("remat: no plan fits %d bytes with %s kept, which run more than once per step: profiling "
             "again with every call of them checkpointed", refused.budget_bytes, names)
    for name in names:
        set_option(modules[name], "recompute")
    try:
        prof = profile_again(refused.budget_bytes)
    except InfeasibleBudget as again:  # its floor, lower than the first's
        raise InfeasibleBudget(
            f"{again} That is with every call of {names} checkpointed, which ran more than once per step.",
            budget_bytes=again.budget_bytes, smallest_bytes=again.smallest_bytes, dominant=again.dominant,
            estimated=again.estimated) from None
    finally:
        for name in names:
            clear_option(modules[name])
    return dataclasses.replace(prof, tied=names, plain_ran=False)
