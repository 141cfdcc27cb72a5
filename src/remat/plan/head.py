"""The head's options in the plan (NOTE [ The head's options ] in ``remat.records``).

The cost model replays one step with one ``post`` segment; a head option is another ``post``.
So a profile with head options is, for the solver, one profile per head option
(``with_head``): the blocks' numbers are the same in each, the segment after them and the step's
time differ. ``best_of_heads`` solves the blocks once per head option, exactly, under the one
budget and keeps the fastest plan that fits (then the lowest peak, then ``keep``, the head as
written); ``frontier_of_heads`` merges the per-head frontiers into one. Pure: no torch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence

from remat.errors import InfeasibleBudget, InvalidValue, did_you_mean
from remat.plan.costmodel import overhead
from remat.plan.segment_estimate import estimate_segments
from remat.records import Estimate, Plan, Profile

__all__ = [
    "HEAD_KEEP",
    "best_of_heads",
    "estimate_with_head",
    "frontier_of_heads",
    "head_extra_ms",
    "head_names",
    "with_head",
]

HEAD_KEEP = "keep"


def head_names(profile: Profile) -> list[str]:
    """``keep`` and the profile's head options, largest chunks first."""
    return [HEAD_KEEP, *sorted(profile.head_options, key=_chunk_key)]


def _chunk_key(name: str) -> tuple[int, str]:
    tail = name.rpartition(":")[2]
    return (-int(tail) if tail.isdigit() else 0, name)


def _check_head(profile: Profile, head: str) -> None:
    if head != HEAD_KEEP and head not in profile.head_options:
        names = head_names(profile)
        raise InvalidValue(
            f"this profile of {profile.model} offers no head option {head!r}; expected one of "
            f"{names}{did_you_mean(str(head), names)}"
            + ("" if profile.head_options else " (no chunkable head was found in its loss path)")
        )


def head_extra_ms(profile: Profile, head: str) -> float:
    """Extra step time of the head option against ``keep``, milliseconds; never below zero: a
    chunked head does the plain head's work and makes its logits again in the backward, so a
    measured saving is noise (on small heads it was: plans at the plain step's own peak chose a
    chunked head predicted 4% faster and measured 2-4% slower)."""
    _check_head(profile, head)
    if head == HEAD_KEEP:
        return 0.0
    seg, post = profile.head_options[head], profile.post
    return max(0.0, (seg.fwd_ms + seg.bwd_ms) - (post.fwd_ms + post.bwd_ms))


def with_head(profile: Profile, head: str) -> Profile:
    """``profile`` with ``head``'s segment as the part after the blocks and no other head option.

    Its plain step time carries the head option's extra time, so that the cost model's step times
    are those of the head option; the side inputs held at the head's forward add what they add to
    ``keep``'s head (measured once, with ``keep``)."""
    _check_head(profile, head)
    if head == HEAD_KEEP:
        return dataclasses.replace(profile, head_options={})
    seg = profile.head_options[head]
    held_extra = profile.post_fwd_peak_held_bytes - profile.post.fwd_peak_bytes
    held_bwd_extra = profile.post_bwd_peak_held_bytes - profile.post.bwd_peak_bytes
    return dataclasses.replace(
        profile,
        post=seg,
        post_fwd_peak_held_bytes=seg.fwd_peak_bytes + held_extra,
        post_bwd_peak_held_bytes=seg.bwd_peak_bytes + held_bwd_extra,
        plain_step_ms=profile.plain_step_ms + head_extra_ms(profile, head),
        head_options={},
    )


def estimate_with_head(
    profile: Profile, choices: Mapping[str, str], head: str = HEAD_KEEP, segments: Sequence[Sequence[str]] = ()
) -> Estimate:
    """``estimate_segments(profile, choices, segments)`` with the head option ``head``; the
    overhead is against the plain step (every block kept, the head as written)."""
    est = estimate_segments(with_head(profile, head), choices, segments)
    return dataclasses.replace(est, overhead=overhead(profile, est.step_ms))


def _finish(profile: Profile, plan: Plan, head: str) -> Plan:
    """``plan`` (solved on ``with_head(profile, head)``) as a plan of ``profile``."""
    notes = list(plan.notes)
    if head != HEAD_KEEP:
        notes.append(f"head: {head} (the loss head's logits one chunk of tokens at a time)")
    return dataclasses.replace(
        plan,
        estimate=estimate_with_head(profile, plan.choices, head, plan.segments),
        head=head,
        head_module=profile.head_module,
        head_causal_lm=profile.head_causal_lm,
        notes=notes,
    )


def best_of_heads(profile: Profile, solve_one: Callable[[Profile], Plan]) -> Plan:
    """The fastest of ``solve_one(with_head(profile, h))`` over the head options ``h`` (then the
    head as written, then the lowest peak, then the earlier in ``head_names``); when none fits,
    the ``InfeasibleBudget`` of the head option with the lowest smallest feasible peak."""
    plans: list[Plan] = []
    errors: list[InfeasibleBudget] = []
    for head in head_names(profile):
        try:
            plan = solve_one(with_head(profile, head))
        except InfeasibleBudget as error:
            errors.append(error)
            continue
        plans.append(_finish(profile, plan, head))
    if not plans:
        raise min(errors, key=lambda e: e.smallest_bytes if e.smallest_bytes is not None else 2**63)
    fits = [p for p in plans if not any(n.startswith("does not fit") for n in p.notes)] or plans
    return min(fits, key=lambda p: (p.estimate.step_ms, p.head != HEAD_KEEP, p.estimate.peak_bytes))


def frontier_of_heads(profile: Profile, frontier_one: Callable[[Profile], list[Plan]]) -> list[Plan]:
    """The memory/time frontier over the head options: every per-head frontier point that no point
    of another head option beats (lower or equal peak and faster, or as fast and lower), by
    decreasing peak and increasing step time."""
    points = [
        _finish(profile, plan, head)
        for head in head_names(profile)
        for plan in frontier_one(with_head(profile, head))
    ]
    points.sort(key=lambda p: (p.estimate.peak_bytes, p.estimate.step_ms))
    kept: list[Plan] = []
    for plan in points:
        if not kept or plan.estimate.step_ms < kept[-1].estimate.step_ms:
            kept.append(plan)
    return kept[::-1]
