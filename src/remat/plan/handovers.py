"""A plan's handovers (NOTE [ Handovers ] in ``remat.records``): the profile's numbers corrected
where they were measured under another saving of a handover than the plan's. Pure numbers.

Each option's numbers come from a step with every block on that option. A handover of block j
that dies in block k's forward phase (freed there when j's option does not save it) is in the
kept bytes of block k as the run of k's option had it: freed there when that run's option of j
does not save it. Under the plan it is freed when j's own option does not save it. So k's kept
bytes move by the handover's bytes times (saved under j's option - saved under k's). One that
dies in the head's forward (after the last block) moves the head's kept bytes the same way against
the kept run, whose numbers the head's are, and its forward peak only up: it may be freed after
the head's peak, so it counts as live there (on the safe side: a language model's head peaks at
its logits, after the loop let it go); the level that stays after the head's
backward moves with them (its gradient bytes) until the maker's backward, where every run has let
it go (the maker's gradient bytes move back), and the backward peaks of the maker and the blocks
after it, measured over the level their own run's head left, move back by what that run saved
beyond the kept run.
Options not run are judged as the run their numbers come from: ``tiled`` and the offloads as
``keep`` and ``recompute``. An offloaded maker's numbers keep nothing on the device, but the
model's code still holds the device tensor until it drops it (the copy is the saved one): that
counts as one more transient in the forward phase where it dies (derived, not measured: no GPU
has run it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from remat.errors import InfeasibleBudget
from remat.records import Handover, Plan, Profile
from remat.units import format_bytes

__all__ = ["Remake", "Search", "bounding", "fitted", "handed_over", "lowest", "segment_neutral"]

_RUN_OF = {"tiled": "keep", "offload": "keep", "recompute_offload": "recompute"}
_OFFLOADS = ("offload", "recompute_offload")


def handed_over(profile: Profile, options: Sequence[str]) -> Profile:
    """``profile`` with its numbers corrected for the handovers under the plan of ``options``
    (one per block); ``profile`` itself when it has none."""
    if not profile.handovers:
        return profile
    index = {b.name: i for i, b in enumerate(profile.blocks)}
    return _corrected(profile, lambda h: _saved(h, options[index[h.made_by]]),
                      lambda h: int(options[index[h.made_by]] in _OFFLOADS))


def segment_neutral(profile: Profile) -> bool:
    """Whether plans with segments count ``profile``'s handovers right: each lives the same with
    its maker kept and recomputed. A segment runs its blocks' first forward as checkpoints and
    replays them kept, so a block inside one is ``keep`` to ``handed_over``; that is its life in
    the segment only when its maker's forward saves it under both or neither (a replay's cache
    alone holds it: NOTE [ A hidden output the model's code holds ] in remat.measure.handovers).
    BLOOM's probabilities, which ``keep`` saves and ``recompute`` does not, are not: the segment
    model does not count them (NOTE [ Handovers ] in remat.records)."""
    return all(_saved(h, "keep") == _saved(h, "recompute") for h in profile.handovers)


Search = Callable[[Profile, int], Plan]
"""A search that sees no handovers: the plan it finds for a profile and a budget (raises
``InfeasibleBudget`` when none fits by its numbers)."""
Remake = Callable[[Plan, list[str]], Plan]
"""The plan with other options per block (same segments), its estimate made anew."""


def fitted(profile: Profile, budget_bytes: int, search: Search, remake: Remake,
           smallest: Callable[[Profile], int]) -> Plan:
    """``search(profile, budget_bytes)``'s plan. With handovers (which ``estimate`` sees and the
    search does not) it is searched again when they put it over or the search finds none: under
    a budget lowered by the excess, and on the profile at its worst case (whose plans fit) and at
    its best (finding plans the per-run numbers put too high); the fastest that fits is then
    improved one block's option at a time while that makes it faster and it fits. None fits:
    ``InfeasibleBudget`` with the lowest peak found (``lowest``; ``smallest`` is a profile's
    smallest feasible peak by its numbers)."""
    if not profile.handovers:
        return search(profile, budget_bytes)
    found = _tried([(profile, budget_bytes)], search)
    over = min((p.estimate.peak_bytes for p in found), default=budget_bytes + 1) - budget_bytes
    if over > 0:
        found += _tried([(profile, budget_bytes - over), (bounding(profile, True), budget_bytes),
                         (bounding(profile, False), budget_bytes)], search)
    fits = [p for p in found if p.estimate.peak_bytes <= budget_bytes]
    if not fits:
        low = lowest(profile, search, remake, smallest)
        if low.estimate.peak_bytes > budget_bytes:
            raise InfeasibleBudget(
                f"budget {format_bytes(budget_bytes)} is below the smallest feasible "
                f"{format_bytes(low.estimate.peak_bytes)} ({low.estimate.peak_bytes} bytes, the peak "
                f"at the {low.estimate.peak_phase}); raise the budget or lower the batch.",
                budget_bytes=budget_bytes, smallest_bytes=low.estimate.peak_bytes,
                dominant=f"the peak falls at the {low.estimate.peak_phase}",
            )
        fits = [low]
    return _improved(profile, min(fits, key=_by_time), remake, _by_time, budget_bytes)


def lowest(profile: Profile, search: Search, remake: Remake, smallest: Callable[[Profile], int]) -> Plan:
    """The plan of the lowest peak found, handovers counted: the searches' plans at the smallest
    feasible peak of the profile and of its best and worst cases, the lowest improved one block's
    option at a time while that lowers its peak."""
    found = _tried([(on, smallest(on)) for on in (profile, bounding(profile, False), bounding(profile, True))],
                   search)
    assert found, "the worst case's smallest feasible peak has a plan"
    return _improved(profile, min(found, key=_by_peak), remake, _by_peak, None)


def _tried(attempts: list[tuple[Profile, int]], search: Search) -> list[Plan]:
    out = []
    for on, target in attempts:
        try:
            out.append(search(on, target))
        except InfeasibleBudget:
            continue
    return out


def _by_time(plan: Plan) -> tuple[float, float]:
    return plan.estimate.step_ms, plan.estimate.peak_bytes


def _by_peak(plan: Plan) -> tuple[float, float]:
    return plan.estimate.peak_bytes, plan.estimate.step_ms


def _improved(profile: Profile, plan: Plan, remake: Remake, rank: Callable[[Plan], tuple[float, float]],
              budget_bytes: int | None) -> Plan:
    """``plan`` with one block's option changed at a time (outside its segments) while that
    lowers its ``rank`` and it still fits ``budget_bytes`` (None: any); a few passes at most."""
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
                fits = budget_bytes is None or other.estimate.peak_bytes <= budget_bytes
                if fits and rank(other) < rank(plan):
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
    return _corrected(profile, lambda h: pick(_saved(h, o) for o in profile.blocks[index[h.made_by]].options),
                      lambda h: pick(int(o in _OFFLOADS) for o in profile.blocks[index[h.made_by]].options))


def _corrected(profile: Profile, saved: Callable[[Handover], int], copied: Callable[[Handover], int]) -> Profile:
    """``profile`` with every option's numbers moved for handovers whose makers save them as
    ``saved`` says (1 or 0; the module's docstring) and offload them as ``copied`` says (their
    numbers count none of it on the device, but the model's code holds the device tensor until it
    drops it: one more transient in the forward where it dies), and no handovers left."""
    index = {b.name: i for i, b in enumerate(profile.blocks)}
    kept = [dict.fromkeys(b.options, 0) for b in profile.blocks]
    bwd = [dict.fromkeys(b.options, 0) for b in profile.blocks]
    fwd = [h.size_bytes * copied(h) for h in profile.handovers]  # per handover
    grad, head, head_peak = [0] * len(profile.blocks), 0, 0
    peak = [0] * len(profile.blocks)
    for h, extra in zip(profile.handovers, fwd):
        j, mine = index[h.made_by], saved(h)
        if h.dies_after is not None:
            k = index[h.dies_after]
            peak[k] += extra
            for o in kept[k]:
                kept[k][o] += h.size_bytes * (mine - _saved(h, o))
            continue
        moved = h.size_bytes * (mine - _saved(h, "keep"))
        head += moved
        head_peak += max(0, moved) + extra  # freed in the head, maybe after its peak: live there
        grad[j] -= moved  # from the maker's backward on, every run has let it go
        for b in range(j, len(profile.blocks)):  # backwards up to the maker's: over the levels
            for o in bwd[b]:  # their runs held, which freed it in the head when they saved it not
                bwd[b][o] -= h.size_bytes * (_saved(h, o) - _saved(h, "keep"))
    blocks = [dataclasses.replace(b, grad_bytes=b.grad_bytes + grad[i], options={
        o: dataclasses.replace(c, kept_bytes=c.kept_bytes + kept[i][o], fwd_peak_bytes=c.fwd_peak_bytes + peak[i],
                               bwd_peak_bytes=c.bwd_peak_bytes + bwd[i][o])
        for o, c in b.options.items()}) for i, b in enumerate(profile.blocks)]
    post = dataclasses.replace(profile.post, kept_bytes=profile.post.kept_bytes + head,
                               fwd_peak_bytes=profile.post.fwd_peak_bytes + head_peak,
                               grad_bytes=profile.post.grad_bytes + head)
    return dataclasses.replace(profile, blocks=blocks, post=post, handovers=[],
                               post_fwd_peak_held_bytes=profile.post_fwd_peak_held_bytes + head_peak)


def _saved(h: Handover, option: str) -> int:
    return int(_RUN_OF.get(option, option) in h.kept_by)
