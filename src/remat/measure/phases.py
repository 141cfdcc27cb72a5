"""The phases of a traced step (NOTE [ The step's schedule ] in ``remat.plan.schedule``): the marks
each starts and ends at (``span``), and their times: per step, each phase's milliseconds
(``phase_times``), and per block, the forward, backward and selective's extra time a profile
records (``block_times``). ``remat.measure.attribution`` reads the bytes along the same spans."""

from __future__ import annotations

import statistics
from collections import defaultdict
from typing import Any

from remat.plan.schedule import Phase, step_phases

__all__ = ["block_times", "median_times", "phase_times", "span"]


def span(phase: Phase, order: list[int], labels: Any) -> tuple[str, str]:
    """The marks a phase starts and ends at in a step whose blocks ran in ``order``."""
    first, last = order[0], order[-1]

    def be(i: int) -> str:
        # A block whose input needs no gradient (the first, behind a frozen embedding) has no
        # backward-end hook; its backward ends where the step's backward does.
        return f"be{i}" if f"be{i}" in labels else "optimizer"

    if phase.part == "optimizer":
        return "optimizer", "end"
    if phase.block is not None:  # NOTE [ Blocks of several stacks ] in remat.measure.attribution
        k, i = phase.block, order[phase.block]
        if phase.stage == "forward":
            return f"fs{i}", f"fs{order[k + 1]}" if k + 1 < len(order) else f"fe{i}"
        return f"bs{i}", f"bs{order[k - 1]}" if k > 0 else be(i)
    if phase.part == "pre":
        return ("forward", f"fs{first}") if phase.stage == "forward" else (be(first), "optimizer")
    return (f"fe{last}", "backward") if phase.stage == "forward" else ("backward", f"bs{last}")


_TIME_KEYS = {("forward", "pre"): "pre_fwd", ("backward", "pre"): "pre_bwd",
              ("forward", "post"): "post_fwd", ("backward", "post"): "post_bwd"}  # fmt: skip


def phase_times(times: dict[str, float], order: list[int]) -> dict[str, float]:
    """Milliseconds of each phase between marks of one step: ``step``, ``pre_fwd``, ``fwd{i}``,
    ``post_fwd``, ``post_bwd``, ``bwd{i}``, ``pre_bwd`` (``i`` a block's index)."""
    out = {"step": times["end"] - times["forward"]}
    for phase in step_phases(len(order)):
        if phase.part == "optimizer":
            continue
        start, end = span(phase, order, times)
        if phase.block is not None:
            key = f"{'fwd' if phase.stage == 'forward' else 'bwd'}{order[phase.block]}"
        else:
            key = _TIME_KEYS[(phase.stage, phase.part)]
        out[key] = times[end] - times[start]
    return out


def median_times(runs: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def block_times(times: dict[str, dict[str, float]], n: int, kinds: list[Any] | None = None) -> tuple[list[float], ...]:
    """Each of ``n`` blocks' forward and backward time with ``keep``, and the extra time of
    selective, from the phase times of each option's run; with ``kinds`` (per block, what makes two
    blocks the same work), each the median of its kind's, and selective as dear as recompute within
    10%."""
    t_keep = times["keep"]
    fwd = [t_keep[f"fwd{i}"] for i in range(n)]
    bwd = [t_keep[f"bwd{i}"] for i in range(n)]
    sel_extra = [0.0] * n
    if "selective" in times:
        t_sel = times["selective"]
        # A selective recompute re-runs every cheap op of the block: never free. When timing
        # noise hides it, charge a tenth of the block's forward (the share of time pointwise ops,
        # norms and softmax take next to the matmuls in a transformer block) rather than zero.
        sel_extra = [
            min(max(0.1 * fwd[i], t_sel[f"fwd{i}"] + t_sel[f"bwd{i}"] - fwd[i] - bwd[i]), fwd[i])
            for i in range(n)
        ]
    if kinds is not None:
        _share_medians(kinds, [fwd, bwd, sel_extra])
        # Selective is worth the bytes it keeps only when it is clearly cheaper than a full
        # recompute. Within timing noise of it (10%) it costs what recompute costs, so that a
        # rerun on a loaded machine does not flip plans between the two.
        sel_extra = [fwd[i] if sel_extra[i] > 0.9 * fwd[i] else sel_extra[i] for i in range(n)]
    return fwd, bwd, sel_extra


def _share_medians(kinds: list[Any], series: list[list[float]]) -> None:
    """Blocks of one kind and size do the same work: give each the median of their times."""
    groups: dict[Any, list[int]] = defaultdict(list)
    for i, kind in enumerate(kinds):
        groups[kind].append(i)
    for members in groups.values():
        for values in series:
            med = statistics.median(values[i] for i in members)
            for i in members:
                values[i] = med
