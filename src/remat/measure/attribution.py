"""From traced steps to a ``Profile``: each part's bytes, read along the step's schedule (its times:
``remat.measure.phases``).

# NOTE [ From a trace to a Profile ]
For each option the profiler replays the cost model's own bookkeeping along the measured marks, so
that ``estimate(profile, every block = option)`` reproduces the measured peak of that step exactly
and mixed plans are additive combinations of measured pieces:
- kept_bytes(block) = live after its forward - live before + its input - its output (its input is
  charged to it, its output to its consumer; see NOTE [ How a block's bytes are attributed ]).
- fwd/bwd_peak_bytes = the measured peak inside the block's forward/backward minus the cost
  model's live level there.
- grad_bytes(block) = live after its backward - live before + its kept bytes.
Offload options are derived, not run: nothing of the block stays on the device, everything it
would keep comes back for its backward, and the copies both ways cost bytes / host-link bandwidth
that compute does not hide (``save_on_cpu`` copies on the compute stream).
The phases are the cost model's own (NOTE [ The step's schedule ] in ``remat.plan.schedule``):
each starts and ends at a mark of the traced step (``span``), and one walk along them gives every
part's kept, peak and gradient bytes, and its times.

# NOTE [ Blocks of several stacks ]
Blocks from several stacks (an encoder and a decoder, two towers) do not follow one another: work
outside every block runs between them (the encoder's final norm, the decoder's embedding). So that
nothing falls between two phases, a block's forward phase runs from its own start to the start of
the next block that runs, and its backward phase from its own start to the start of the previous
block's backward; the work between two blocks is charged to the block before it in the forward,
and its backward to the block after it, whose backward phase it ends. A block hands on what the
next block receives rather than its own output. Along a single chain nothing runs between blocks and the numbers are
those of the blocks alone. The phases then tile the step, and the parts' kept bytes add up to what
the forward leaves live, for every option run.

# NOTE [ The last block's input ]
A loop ``x = block(x)`` holds a block's input until the block returns and ``x`` is rebound: after
the block's forward-end mark. For every block but the last that moment falls in its own forward
phase (which runs to the next block's start), but the last block's phase ends at its own end, so
an input the kept block does not save (its first op saves nothing of it: ``lin(sin(x + s))``)
dies in the head's forward. A checkpoint saves its inputs, so under recompute it lives to the
backward instead, and numbers read as they fall would charge that death to the head under every
option: a pure-torch loop measured its recompute plans up to 240 KiB over their prediction. So
the kept step's numbers are restated as if the last block freed it: its kept and gradient bytes
lose the input's bytes, and the head's kept, gradient and forward-peak bytes gain them (its
level is lower by them); another option's run loses them from the last block's kept bytes only
where that run freed the input in the head too (``run_numbers``). Equal totals, and every plan's
phases as measured.

# NOTE [ Gradients live as long as the plain step's ]
A profile has one ``grad_bytes`` per block, read from the step with every block kept. The moment
autograd frees the gradient flowing into a block moves with the option: on the ResNet with
BatchNorm (tests/test_reach.py) the four blocks where the hidden state changes shape showed +2.0,
+2.2, +4.1 and -8.0 MiB of gradients with every block kept and half that with every block
recomputed (the sums agree). Read against its own run's level, the recomputed run's backward peaks
were 4 MiB too high once the cost model combined them with the kept run's gradients, and no plan
reached the peak of torch's checkpoint on every block. So each option's backward peaks are read
against the level the cost model itself replays for that run: that run's kept bytes, the kept
run's gradients, and the side inputs as that plan holds them (its run measured them held, and
``remat.plan.sides`` adds them), so that ``estimate`` of every block on one option reproduces
that run's measured peak, and side-input frees are not counted twice.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from torch import nn

from remat.crossing import Crossing
from remat.errors import ProfileError
from remat.manual.batchnorm import snapshot_bytes
from remat.manual.blocks import fingerprint
from remat.measure import storages as _storages
from remat.measure.handovers import read_handovers
from remat.measure.notes import PartNumbers, StepNotes
from remat.measure.phases import block_times, span
from remat.measure.saved import cached_skips, replay_holds_output
from remat.measure.sides import head_frees_last_input
from remat.measure.tracer import Trace
from remat.plan.handovers import saved_under
from remat.plan.schedule import step_phases
from remat.plan.sides import group_sides
from remat.records import BlockProfile, OptionCost, Profile, Segment

__all__ = ["assemble", "attribute", "attribute_head", "attribute_over_keep", "run_numbers"]


def attribute(
    trace: Trace, hooks: StepNotes, n: int
) -> tuple[Segment, Segment, list[PartNumbers], int]:
    """Replay the cost model along the trace (NOTE [ From a trace to a Profile ]): the ``pre``
    and ``post`` segments, each block's numbers (by index), the optimizer step's peak."""
    live = {m.label: m.live_bytes for m in trace.marks}
    first = {m.label: k for k, m in reversed(list(enumerate(trace.marks)))}
    last_save = {m.label: k for k, m in enumerate(trace.marks) if m.label.startswith("sv")}
    order = hooks.order
    parts: dict[Any, PartNumbers] = {"pre": PartNumbers(), "post": PartNumbers(), **{i: PartNumbers() for i in range(n)}}
    level = optimizer_peak = 0
    for phase in step_phases(len(order)):
        start, end = span(phase, order, live)
        peak = trace.peak_between(start, end)
        if phase.part == "optimizer":
            optimizer_peak = peak - live[start]
            continue
        key = order[phase.block] if phase.block is not None else phase.part
        numbers = parts[key]
        if phase.stage == "forward":
            received, handed = _boundary(key, hooks)
            numbers.kept = live[end] - live[start] + received - handed
            numbers.fwd_peak = peak - level
            if (stop := last_save.get(f"sv{key}")) is not None:  # BlockProfile.stop_peak_bytes
                numbers.stop_peak = trace.peak_over(first[start], stop) - level
            level += numbers.kept
        else:
            numbers.bwd_peak = peak - level
            numbers.bwd_level = level
            if (read := first.get(f"un{key}")) is not None:  # BlockProfile.unpack_bytes
                numbers.unpack = trace.marks[read].live_bytes - live[start]
            numbers.grad = live[end] - live[start] + numbers.kept
            level += numbers.grad - numbers.kept
    pre, post = (
        Segment(kept_bytes=s.kept, fwd_peak_bytes=s.fwd_peak, bwd_peak_bytes=s.bwd_peak,
                grad_bytes=s.grad, fwd_ms=0.0, bwd_ms=0.0)
        for s in (parts["pre"], parts["post"])
    )  # fmt: skip
    return pre, post, [parts[i] for i in range(n)], optimizer_peak


def run_numbers(run: tuple[Trace, StepNotes], keep: StepNotes, n: int,
                numbers: list[PartNumbers] | None = None) -> list[PartNumbers]:
    """One option's run's block numbers (``numbers``, if read already), the last block's kept
    bytes restated where that run and the kept one freed its input in the head (NOTE [ The last block's input ])."""
    numbers = attribute(*run, n)[2] if numbers is None else numbers
    if (freed := head_frees_last_input(keep)) and head_frees_last_input(run[1]):
        numbers[run[1].order[-1]].kept -= freed
    return numbers


def _last_input_restated(post: Segment, keep_blocks: list[PartNumbers], hooks: StepNotes) -> Segment:
    """The kept step's head (its last block's numbers in place) restated: NOTE [ The last block's input ]."""
    if freed := head_frees_last_input(hooks):
        keep_blocks[hooks.order[-1]].kept -= freed
        keep_blocks[hooks.order[-1]].grad -= freed
    return _head_restated(post, freed)


def _head_restated(post: Segment, freed: int) -> Segment:
    return dataclasses.replace(post, kept_bytes=post.kept_bytes + freed, grad_bytes=post.grad_bytes + freed,
                               fwd_peak_bytes=post.fwd_peak_bytes + freed)


def attribute_head(trace: Trace, hooks: StepNotes, n: int) -> Segment:
    """The head of a step with every block kept and another head option (``remat.measure.heads``),
    restated as the kept step's head is (NOTE [ The last block's input ]): the blocks' numbers
    come from the kept step, so a head that frees the last block's input carries its bytes."""
    return _head_restated(attribute(trace, hooks, n)[1], head_frees_last_input(hooks))


def attribute_over_keep(run: tuple[Trace, StepNotes], keep: tuple[Trace, StepNotes],
                        named: list[tuple[str, nn.Module]], sides: list[Crossing]) -> list[PartNumbers]:
    """One option's run's block numbers, backward peaks over the cost model's level as ``assemble``
    restates its runs (NOTE [ Gradients live as long as the plain step's ]), for an option that
    holds side inputs as ``keep`` does (``remat.plan.sides.saves_as_kept``)."""
    pre, post, keep_blocks, _ = attribute(*keep, len(named))
    post = _last_input_restated(post, keep_blocks, keep[1])  # as assemble restates the kept step
    numbers = run_numbers(run, keep[1], len(named))
    _peaks_over_model_level(numbers, keep_blocks, pre, post, keep[1].order, named, sides, "keep")
    return numbers


def _boundary(key: Any, hooks: StepNotes) -> tuple[int, int]:
    """The bytes a part receives as input and hands on as output. A part's input is charged to
    it, its output to the part that consumes it (NOTE [ How a block's bytes are attributed ])."""
    order = hooks.order
    if key == "pre":
        return 0, hooks.in_bytes[order[0]]
    if key == "post":
        return hooks.out_bytes[order[-1]], 0
    k = order.index(key)  # it hands on what the next block receives (NOTE [ Blocks of several stacks ])
    return hooks.in_bytes[key], hooks.in_bytes[order[k + 1]] if k + 1 < len(order) else hooks.out_bytes[key]


def assemble(
    *,
    model: nn.Module,
    named: list[tuple[str, nn.Module]],
    traces: Mapping[str, tuple[Trace, StepNotes]],
    times: dict[str, dict[str, float]],
    host_link_bytes_per_s: float | None,
    smooth: bool,
    sides: list[Crossing] | None = None,
    **fixed: Any,
) -> Profile:
    """The ``Profile`` of traced steps: ``traces`` and ``times`` per option run (``keep`` always),
    ``fixed`` the fields that come from the step's setup (device, mode, base bytes, ...)."""
    trace_keep, hooks_keep = traces["keep"]
    order = hooks_keep.order
    _check_every_block_ran(named, order)
    pre, post, keep_blocks, optimizer_peak = attribute(trace_keep, hooks_keep, len(named))
    post = _last_input_restated(post, keep_blocks, hooks_keep)  # NOTE [ The last block's input ]
    runs = {o: attribute(*traces[o], len(named)) for o in ("selective", "recompute") if o in traces}
    per_option = {"keep": keep_blocks} | {o: run_numbers(traces[o], hooks_keep, len(named), run[2])
                                          for o, run in runs.items()}
    index = {name: i for i, (name, _) in enumerate(named)}
    if sides and "selective" in traces and "recompute" in traces:  # NOTE [ A skip from a block's output ] in sides
        sides = cached_skips(sides, traces["selective"][1], traces["recompute"][1], [n for n, _ in named])
    for option, numbers in per_option.items():
        if numbers is not keep_blocks:
            for side in sides or []:  # NOTE [ Where a side input dies ] in remat.plan.sides
                if side.dies_after is not None:
                    numbers[index[side.dies_after]].kept -= side.size_bytes
            _peaks_over_model_level(numbers, keep_blocks, pre, post, order, named, sides or [], option)
    if "selective" in per_option and "recompute" in traces:  # NOTE [ A replay's cache holds the block's output ] in saved
        selective, recompute = (traces[o][1] for o in ("selective", "recompute"))
        for i in replay_holds_output(selective, recompute, hooks_keep):
            per_option["selective"][i].kept += hooks_keep.out_bytes[i]
    # The head's forward with the side inputs still held: every block recomputed holds them.
    held = runs["recompute"][1].fwd_peak_bytes if sides and "recompute" in runs else post.fwd_peak_bytes
    held_bwd = runs["recompute"][1].bwd_peak_bytes if sides and "recompute" in runs else post.bwd_peak_bytes
    # NOTE [ Tensors that cross a block boundary ] in remat.crossing: the ones that enter no block
    handed = read_handovers([n for n, _ in named], {o: h for o, (_, h) in traces.items()})
    if sides and "recompute" in runs:  # as if the handovers freed in the head were saved as kept
        held += sum(h.size_bytes * (saved_under(h, "keep") - saved_under(h, "recompute"))
                    for h in handed if h.dies_after is None)
    param_bytes = [_storages.storage_bytes(list(m.parameters())) for _, m in named]
    kinds = [(type(m).__name__, param_bytes[i], hooks_keep.in_bytes[i], keep_blocks[i].kept)
             for i, (_, m) in enumerate(named)]
    fwd, bwd, sel_extra = block_times(times, len(named), kinds if smooth else None)
    blocks = [
        BlockProfile(
            name=name,
            kind=type(module).__name__,
            param_bytes=param_bytes[i],
            grad_bytes=keep_blocks[i].grad,
            input_bytes=hooks_keep.in_bytes[i],
            fwd_ms=fwd[i],
            bwd_ms=bwd[i],
            options=_options(i, per_option, fwd[i], sel_extra[i], host_link_bytes_per_s),
            stop_peak_bytes=keep_blocks[i].stop_peak,
            unpack_bytes=keep_blocks[i].unpack,
            saves=keep_blocks[i].saves,
            stats_bytes=snapshot_bytes((module,)),
        )
        for i, (name, module) in enumerate(named)
    ]
    t_keep = times["keep"]
    return Profile(
        model=type(model).__name__,
        pre=_with_times(pre, t_keep["pre_fwd"], t_keep["pre_bwd"]),
        post=_with_times(post, t_keep["post_fwd"], t_keep["post_bwd"]),
        blocks=[blocks[i] for i in order],
        optimizer_peak_bytes=optimizer_peak,
        plain_peak_bytes=fixed["base_bytes"] + trace_keep.peak_bytes,
        plain_step_ms=t_keep["step"],
        crossings=[*(sides or []), *handed],
        post_fwd_peak_held_bytes=held,
        post_bwd_peak_held_bytes=held_bwd,
        **{"fingerprint": fingerprint(model), **fixed},  # a lean profile's is the user's model's
    )


def _peaks_over_model_level(
    numbers: list[PartNumbers], keep: list[PartNumbers], pre: Segment, post: Segment,
    order: list[int], named: list[tuple[str, nn.Module]], sides: list[Crossing], held_as: str,
) -> None:
    """Restate the backward peaks of one option's run (every block checkpointed the same way)
    over the live level the cost model replays for that plan, not the level of the run itself
    (NOTE [ Gradients live as long as the plain step's ])."""
    names = [named[i][0] for i in order]
    groups = group_sides(sides, names, unsaving=frozenset(k for k, i in enumerate(order) if not keep[i].saves))
    level = pre.kept_bytes + sum(numbers[i].kept for i in order) + post.grad_bytes
    held, so_far = [], 0  # the groups held at each block's backward, as the cost model replays
    for k in range(len(order)):
        so_far |= groups.holds(k, held_as)
        held.append(so_far)
    for k in range(len(order) - 1, -1, -1):
        own = numbers[order[k]]
        model = level + groups.delta_bytes(held[k], k)
        own.bwd_peak += own.bwd_level - model
        level += keep[order[k]].grad - own.kept


def _check_every_block_ran(named: list[tuple[str, nn.Module]], order: list[int]) -> None:
    if sorted(order) != list(range(len(named))):
        missing = [named[i][0] for i in range(len(named)) if i not in order]
        raise ProfileError(
            f"blocks {missing} did not run in the step; remat plans blocks that run once per "
            "step with gradients (check blocks=)"
        )


def _options(i: int, per_option: dict[str, list[PartNumbers]], fwd_ms: float,
             sel_extra_ms: float, host_link_bytes_per_s: float | None) -> dict[str, OptionCost]:
    """Block ``i``'s cost under each option: those run, and the offloads derived from them."""
    options: dict[str, OptionCost] = {"keep": per_option["keep"][i].cost(0.0)}
    if "selective" in per_option:
        options["selective"] = per_option["selective"][i].cost(sel_extra_ms)
    if "recompute" in per_option:
        options["recompute"] = per_option["recompute"][i].cost(fwd_ms)
    if host_link_bytes_per_s:
        k, r = per_option["keep"][i], per_option["recompute"][i]
        options["offload"] = OptionCost(
            kept_bytes=0,
            fwd_peak_bytes=k.fwd_peak,
            bwd_peak_bytes=k.bwd_peak + k.kept,
            extra_ms=2 * k.kept / host_link_bytes_per_s * 1e3,
        )
        options["recompute_offload"] = OptionCost(
            kept_bytes=0,
            fwd_peak_bytes=r.fwd_peak,
            bwd_peak_bytes=r.bwd_peak + r.kept,
            extra_ms=fwd_ms + 2 * r.kept / host_link_bytes_per_s * 1e3,
        )
    return options


def _with_times(seg: Segment, fwd_ms: float, bwd_ms: float) -> Segment:
    return Segment(
        kept_bytes=seg.kept_bytes, fwd_peak_bytes=seg.fwd_peak_bytes, bwd_peak_bytes=seg.bwd_peak_bytes,
        grad_bytes=seg.grad_bytes, fwd_ms=fwd_ms, bwd_ms=bwd_ms,
    )
