"""Profiling again with every call of a tied module checkpointed, where no plan fits without.

# NOTE [ Every call of a tied module ]
A module the model runs more than once per step (a weight-tied layer: ALBERT's shared layer,
perceiver-pytorch's ``weight_tie_layers``, MONAI SegResNetVAE's decoder, run for the segmentation
and again for the VAE) is no block, and is kept (rule 6 of NOTE [ Blocks by what runs ] in
``remat.manual.settle``): the cost model replays each block once. Its activations can be most of
the step's, and torch's checkpoint around each of its calls drops them. So:
1. Where a profile is made for a budget (``remat.profile(..., budget=)``, ``remat.auto``; measured
   or on fake tensors) and no plan fits it with those modules kept (``Profile.repeated``; the
   refusal's ``InfeasibleBudget.repeated``), the profile is made again, for the same budget and by
   the same rules, with every call of each of them checkpointed (the option ``recompute``): the
   profile of that step, planned around them as around a user's ``checkpoint_module``.
2. Only then: where a plan fits with them kept, recomputing them on every call is more than the
   budget needs (ALBERT's shared layer is its whole encoder). All of them or none.
3. The profile names them (``Profile.tied``), and so do its plans (``Plan.tied``): ``apply`` sets
   their option as a block's, ``remove`` takes it off. Profiling leaves the model as it was, and
   profiles an applied plan's tied modules as the user wrote them (``as_written``).
4. That profile's plain step is the step with them checkpointed, which may run: a plan's overhead
   is counted from it and leaves out their own recompute (the plan's note says so). The step with
   them kept never runs (``Profile.plain_ran`` is False), so ``verify`` does not run it either.
5. Blocks the user names (``blocks=``) leave the rest of the model to the user: nothing is tied. A
   profile made without a budget ties nothing, and a refusal from it names them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Iterator

from torch import nn

from remat.errors import InfeasibleBudget
from remat.manual.options import clear_option, set_option
from remat.plan.refusals import infeasible
from remat.plan.solver import smallest_any
from remat.records import Profile
from remat.units import parse_budget

__all__ = ["every_call", "tied_where_needed"]

log = logging.getLogger(__name__)


def tied_where_needed(budget: int | str | None, make: Callable[[int | str | None, list[str]], Profile]) -> Profile:
    """The profile ``make(budget, tied)`` makes with every call of ``tied`` checkpointed: none, or,
    where no plan fits ``budget`` with them kept, the modules that ran more than once (NOTE
    [ Every call of a tied module ])."""
    try:
        prof = make(budget, [])
    except InfeasibleBudget as e:
        if budget is None or not e.repeated:
            raise
        refused = e
    else:
        if budget is None or not prof.repeated or (over := _refusal(prof, budget)) is None:
            return prof
        refused = over
    names = refused.repeated
    log.info("remat: no plan fits %d bytes with %s kept, which ran more than once per step: profiling "
             "again with every call of them checkpointed", refused.budget_bytes, names)
    try:
        prof = make(refused.budget_bytes, names)
    except InfeasibleBudget as again:  # its floor, lower than the first's
        raise InfeasibleBudget(
            f"{again} That is with every call of {names} checkpointed, which ran more than once per step.",
            budget_bytes=again.budget_bytes, smallest_bytes=again.smallest_bytes, dominant=again.dominant,
            estimated=again.estimated) from None
    return dataclasses.replace(prof, tied=names, plain_ran=False)


@contextlib.contextmanager
def every_call(model: nn.Module, names: list[str]) -> Iterator[None]:
    """Every call of the modules ``names`` of ``model`` checkpointed while inside; their own
    forwards put back after, whatever happens."""
    modules = dict(model.named_modules())
    try:
        for name in names:
            set_option(modules[name], "recompute")
        yield
    finally:
        for name in names:
            clear_option(modules[name])


def _refusal(prof: Profile, budget: int | str) -> InfeasibleBudget | None:
    """The refusal of ``budget`` for ``prof``, or None where a plan fits: a profile made for it whose
    plain step ran (a model that runs no step on fake tensors), or one made on fake tensors alone."""
    budget_bytes = parse_budget(budget, plain_peak_bytes=prof.plain_peak_bytes,
                                device_memory_bytes=prof.device_memory_bytes)
    smallest, dominant = smallest_any(prof)
    return infeasible(prof, budget_bytes, smallest, dominant) if smallest > budget_bytes else None
