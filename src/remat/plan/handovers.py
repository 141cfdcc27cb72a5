"""A plan's handovers (NOTE [ Handovers ] in ``remat.records``): the profile's numbers corrected
where they were measured under another saving of a handover than the plan's. Pure numbers.

Each option's numbers come from a step with every block on that option. A handover of block j
that dies in block k's forward phase (freed there when j's option does not save it) is in the
kept bytes of block k as the run of k's option had it: freed there when that run's option of j
does not save it. Under the plan it is freed when j's own option does not save it. So k's kept
bytes move by the handover's bytes times (saved under j's option - saved under k's). One that
dies in the head's forward (after the last block) moves the head's kept bytes and forward peak the
same way against the kept run, whose numbers the head's are; the level that stays after the head's
backward moves with them (its gradient bytes), and each block's backward peak, measured over the
level its own run's head left, moves back by what that run saved beyond the kept run.
Options not run are judged as the run their numbers come from: ``tiled`` and the offloads as
``keep`` and ``recompute`` (the offloads' copies leave the handover itself where it is: not
modelled).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from remat.errors import InfeasibleBudget
from remat.records import BlockProfile, Handover, OptionCost, Plan, Profile
from remat.units import format_bytes

__all__ = ["bounding", "fitted", "handed_over"]

_RUN_OF = {"tiled": "keep", "offload": "keep", "recompute_offload": "recompute"}


def handed_over(profile: Profile, options: Sequence[str]) -> Profile:
    """``profile`` with the numbers of the chosen ``options`` (one per block) corrected for the
    handovers under that plan; ``profile`` itself when it has none."""
    if not profile.handovers:
        return profile
    index = {b.name: i for i, b in enumerate(profile.blocks)}
    kept = [0] * len(profile.blocks)
    bwd = [0] * len(profile.blocks)
    head = 0
    for h in profile.handovers:
        mine = _saved(h, options[index[h.made_by]])
        if h.dies_after is not None:
            k = index[h.dies_after]
            kept[k] += h.size_bytes * (mine - _saved(h, options[k]))
            continue
        head += h.size_bytes * (mine - _saved(h, "keep"))
        for b, option in enumerate(options):
            bwd[b] -= h.size_bytes * (_saved(h, option) - _saved(h, "keep"))
    blocks = [
        b if not (kept[i] or bwd[i]) else dataclasses.replace(b, options={
            **b.options, o: _moved(b.options[o], kept[i], bwd[i])})
        for i, (b, o) in enumerate(zip(profile.blocks, options))
    ]
    return _with_head(profile, blocks, head)


def fitted(profile: Profile, budget_bytes: int, search: Callable[[Profile, int], Plan],
           remake: Callable[[Plan, list[str]], Plan]) -> Plan:
    """``search(profile, budget_bytes)``'s plan, for a search that sees no handovers. When they
    put it over the budget (by ``estimate``, which sees them), the fastest that fits of the plans
    found again: under a budget lowered by the excess, and on the profile at its worst case (whose
    plans fit) and at its best (finding plans the per-run numbers put too high). With handovers,
    the plan is then improved one block's option at a time (``remake``: the plan with other
    options) while that makes it faster and it fits."""
    first = search(profile, budget_bytes)
    if not profile.handovers:
        return first
    again, over = [first], first.estimate.peak_bytes - budget_bytes
    if over > 0:
        for on, target in ((profile, budget_bytes - over), (bounding(profile, True), budget_bytes),
                           (bounding(profile, False), budget_bytes)):
            try:
                again.append(search(on, target))
            except InfeasibleBudget:
                continue
    fits = [p for p in again if p.estimate.peak_bytes <= budget_bytes]
    if not fits:
        lowest = min(p.estimate.peak_bytes for p in again)
        raise InfeasibleBudget(
            f"budget {format_bytes(budget_bytes)} ({budget_bytes} bytes): the plans found peak above "
            f"it once the tensors the blocks hand to one another are counted (the lowest at {lowest} "
            "bytes); raise the budget or lower the batch.",
            budget_bytes=budget_bytes, smallest_bytes=lowest, dominant="tensors handed between blocks",
        )
    return _improved(profile, budget_bytes, min(fits, key=_rank), remake)


def _rank(plan: Plan) -> tuple[float, int]:
    return plan.estimate.step_ms, plan.estimate.peak_bytes


def _improved(profile: Profile, budget_bytes: int, plan: Plan, remake: Callable[[Plan, list[str]], Plan]) -> Plan:
    """``plan`` with one block's option changed at a time (outside its segments) while that makes
    it faster, or as fast and lower, and it still fits; a few passes at most."""
    names = [b.name for b in profile.blocks]
    inside = {j for first, last in plan.segments for j in range(names.index(first), names.index(last) + 1)}
    for _ in range(4):
        better = False
        for i in (i for i in range(len(names)) if i not in inside):
            for option in profile.options:
                picks = [plan.choices[n] for n in names]
                if picks[i] == option:
                    continue
                picks[i] = option
                other = remake(plan, picks)
                if other.estimate.peak_bytes <= budget_bytes and _rank(other) < _rank(plan):
                    plan, better = other, True
        if not better:
            break
    return plan


def bounding(profile: Profile, worst: bool) -> Profile:
    """``profile`` with every option's numbers moved to the most (``worst``) or the least its
    handovers can add under any plan (each maker on an option that saves them, or on one that does
    not): every plan's peak on the worst case is at least its own (``handed_over``), so the
    searches' plans on it fit; on the best case at most, so they find plans that the per-run
    numbers put too high."""
    pick = max if worst else min
    index = {b.name: i for i, b in enumerate(profile.blocks)}
    kept: list[dict[str, int]] = [dict.fromkeys(b.options, 0) for b in profile.blocks]
    bwd: list[dict[str, int]] = [dict.fromkeys(b.options, 0) for b in profile.blocks]
    head = 0
    for h in profile.handovers:
        most = pick(_saved(h, o) for o in profile.blocks[index[h.made_by]].options)
        if h.dies_after is not None:
            k = index[h.dies_after]
            for o in kept[k]:
                kept[k][o] += h.size_bytes * (most - _saved(h, o))
            continue
        head += h.size_bytes * (most - _saved(h, "keep"))
        for b in bwd:
            for o in b:
                b[o] -= h.size_bytes * (_saved(h, o) - _saved(h, "keep"))
    blocks = [dataclasses.replace(b, options={o: _moved(c, kept[i][o], bwd[i][o]) for o, c in b.options.items()})
              for i, b in enumerate(profile.blocks)]
    return _with_head(profile, blocks, head)


def _with_head(profile: Profile, blocks: list[BlockProfile], head: int) -> Profile:
    """``profile`` with ``blocks``, no handovers, and the head's numbers moved by ``head`` bytes."""
    post = dataclasses.replace(
        profile.post, kept_bytes=profile.post.kept_bytes + head,
        fwd_peak_bytes=profile.post.fwd_peak_bytes + head, grad_bytes=profile.post.grad_bytes + head,
    )
    return dataclasses.replace(profile, blocks=blocks, post=post, handovers=[],
                               post_fwd_peak_held_bytes=profile.post_fwd_peak_held_bytes + head)


def _saved(h: Handover, option: str) -> int:
    return int(_RUN_OF.get(option, option) in h.kept_by)


def _moved(cost: OptionCost, kept: int, bwd: int) -> OptionCost:
    return dataclasses.replace(cost, kept_bytes=cost.kept_bytes + kept, bwd_peak_bytes=cost.bwd_peak_bytes + bwd)
