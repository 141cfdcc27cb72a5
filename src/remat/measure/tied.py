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
   budget needs (ALBERT's shared layer is its whole encoder). All of them (rule 7 aside) or none.
3. The profile names them (``Profile.tied``), and so do its plans (``Plan.tied``): ``apply`` sets
   their option as a block's, ``remove`` takes it off. Profiling leaves the model as it was, and
   profiles an applied plan's tied modules as the user wrote them (``as_written``).
4. That profile's plain step is the step with them checkpointed, which may run; the step with them
   kept never runs (``Profile.plain_ran`` is False), so ``verify`` does not run it either. A plan's
   overhead is against the step with them kept: the profile's plain step less their recompute,
   timed as their calls in a forward without gradients, which holds none of the step's activations
   (``Profile.tied_ms``; on fake tensors, not timed: 0, and the plan's note says so). Its plain
   peak is that step's too (``Profile.plain_peak_bytes``, as the refusal named it), of which a
   budget such as ``"60%"`` is a share.
5. Blocks the user names (``blocks=``) leave the rest of the model to the user: nothing is tied. A
   profile made without a budget ties nothing, and a refusal from it names them.
6. A module inside a block is replayed by it, and is never tied: ncps' CfC, a block, calls its
   cell's layers once per time step, and tying them inside it raised the floor from 18,496,384 B
   to 22,337,232. Where the floor with them tied is no lower, the first refusal stands.
7. Where a step with them tied fails (a module whose calls cannot be replayed: a recurrent
   layer that reads a state its previous call set, block-recurrent-transformer's), the module
   whose call the error came through stays as the model runs it, and the rest are tied again,
   until a step runs; a warning says which. Where none is left, or the error names none of them
   (on fake tensors), the first refusal stands. block-recurrent-transformer, 4 layers of
   attention and feed-forward, each run 8 times: 7 tied, its recurrent attention kept, reach
   30,991,136 B of its 73,548,064 (torch's checkpoint on the feed-forwards alone: 49,264,928).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import statistics
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from remat.errors import InfeasibleBudget
from remat.manual.options import clear_option, set_option
from remat.measure import clock
from remat.measure import step as _step
from remat.measure.preserve import preserved
from remat.plan.refusals import infeasible
from remat.plan.solver import smallest_any
from remat.records import Profile
from remat.units import parse_budget

__all__ = ["calls_ms", "every_call", "tie", "tied_where_needed"]

log = logging.getLogger(__name__)


def tied_where_needed(budget: int | str | None, make: Callable[[int | str | None, list[str]], Profile],
                      forward_ms: Callable[[list[str]], float] | None = None) -> Profile:
    """The profile ``make(budget, tied)`` makes with every call of ``tied`` checkpointed: none, or,
    where no plan fits ``budget`` with them kept, the modules that ran more than once (NOTE
    [ Every call of a tied module ]); ``forward_ms(tied)``: their calls' time in one forward, what
    their recompute adds to a step (``Profile.tied_ms``; None: not timed)."""
    first: Profile | None = None  # the profile with them kept, where one was made
    try:
        first = make(budget, [])
    except InfeasibleBudget as e:
        if budget is None or not e.repeated:
            raise
        refused = e
    else:
        if budget is None or not first.repeated or (over := _refusal(first, budget)) is None:
            return first
        refused = over
    names, plain = refused.repeated, refused.plain_bytes
    log.info("remat: no plan fits %d bytes with %s kept, which ran more than once per step: profiling "
             "again with every call of them checkpointed", refused.budget_bytes, names)
    while True:
        try:
            prof = make(refused.budget_bytes, names)
            break
        except InfeasibleBudget as again:
            if again.smallest_bytes >= refused.smallest_bytes:  # rule 6: no lower
                raise refused from None
            raise InfeasibleBudget(
                f"{again} That is with every call of {names} checkpointed, which ran more than once per step.",
                budget_bytes=again.budget_bytes, smallest_bytes=again.smallest_bytes, dominant=again.dominant,
                estimated=again.estimated, plain_bytes=plain) from None
        except Exception as e:  # rule 7: a module whose calls cannot be replayed
            failed = _raised_in(e, names)
            left = [n for n in names if n != failed] if failed is not None else []
            log.warning("remat: a step with every call of %s checkpointed failed (%s: %s): %s", names,
                        type(e).__name__, str(e).split("\n")[0][:200],
                        f"{failed} stays as the model runs it" if left else "they stay as the model runs them")
            if not left:
                if first is None:
                    raise refused from e
                return first
            names = left
    if first is not None and (low := _refusal(prof, refused.budget_bytes)) and low.smallest_bytes >= refused.smallest_bytes:
        return first  # rule 6: no lower
    return dataclasses.replace(prof, tied=names, plain_ran=False, tied_ms=forward_ms(names) if forward_ms else 0.0,
                               plain_peak_bytes=plain if plain is not None else prof.plain_peak_bytes)


def _raised_in(error: BaseException, names: list[str]) -> str | None:
    """The one of the modules ``names`` whose call ``error`` came through (the innermost), or None.
    The model that ran it (the user's, or a fake copy of it) is a local of a frame it came through."""
    frames = []
    tb = error.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    named: dict[int, str] = {}
    for root in (v for f in frames for v in f.f_locals.values() if isinstance(v, nn.Module)):
        for name in names:
            with contextlib.suppress(AttributeError):
                named.setdefault(id(root.get_submodule(name)), name)
    return next((named[id(s)] for f in reversed(frames) if id(s := f.f_locals.get("self")) in named), None)


def tie(model: nn.Module, names: list[str]) -> None:
    """Checkpoint every call of the modules ``names`` of ``model`` (the option ``recompute``)."""
    modules = dict(model.named_modules())
    for name in names:
        set_option(modules[name], "recompute")


@contextlib.contextmanager
def every_call(model: nn.Module, names: list[str]) -> Iterator[None]:
    """Every call of the modules ``names`` of ``model`` checkpointed while inside; their own
    forwards put back after, whatever happens."""
    try:
        tie(model, names)
        yield
    finally:
        for name in names:
            clear_option(model.get_submodule(name))


def calls_ms(model: nn.Module, batch: Any, loss_fn: Any, names: list[str], repeats: int) -> float:
    """The time of the calls of the modules ``names`` of ``model`` in one forward on ``batch``
    without gradients (none of the step's activations held), ms: the median of ``repeats``, after
    one untimed. The model is left as it was (its buffers and the RNG state put back)."""
    device = _step.batch_device(model, batch)
    modules = [model.get_submodule(n) for n in names]
    inside, started, total = [0], [0.0], [0.0]

    def enter(*_: Any) -> None:
        inside[0] += 1
        if inside[0] == 1:  # the outermost call: a tied module may hold another
            started[0] = clock.step_clock_ms(device)

    def leave(*_: Any) -> None:
        inside[0] -= 1
        if inside[0] == 0:
            total[0] += clock.step_clock_ms(device) - started[0]

    handles = [h for m in modules for h in (m.register_forward_pre_hook(enter), m.register_forward_hook(leave))]
    times = []
    try:
        with preserved(model), torch.no_grad(), clock.no_gc():
            for _ in range(repeats + 1):
                total[0] = 0.0
                _step.forward_loss(model, batch, loss_fn)
                times.append(total[0])
    finally:
        for h in handles:
            h.remove()
    return statistics.median(times[1:])


def _refusal(prof: Profile, budget: int | str) -> InfeasibleBudget | None:
    """The refusal of ``budget`` for ``prof``, or None where a plan fits: a profile made for it whose
    plain step ran (a model that runs no step on fake tensors), or one made on fake tensors alone."""
    budget_bytes = parse_budget(budget, plain_peak_bytes=prof.plain_peak_bytes,
                                device_memory_bytes=prof.device_memory_bytes)
    smallest, dominant = smallest_any(prof)
    return infeasible(prof, budget_bytes, smallest, dominant) if smallest > budget_bytes else None
