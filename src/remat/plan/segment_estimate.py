"""A whole plan with segments: its peak and time, from the segment model of its profile
(``remat.plan.segments``) and the per-block chain around its segments. Pure: no torch.

# NOTE [ Handovers in a segment ]
A handover (shape 2 of NOTE [ Tensors that cross a block boundary ] in ``remat.crossing``) lives by
its maker's option, and a block inside a segment is two things:
1. In the forward, a call of the frame, which saves nothing: the model's code holds what the block
   made until it drops it, as under ``recompute``. The forward reads the profile corrected
   (``remat.plan.handovers``) as if every block inside a segment were recomputed.
2. In the replay, a kept block with no model code around it: nothing is dropped, and what ``keep``
   saves lives to the block's backward. The replay reads the ``keep`` numbers as measured.
3. What the model's code holds is no part of what a call stashes: the segment model takes it out
   of the RNG state and the code-after-the-block bytes it reads off the recompute numbers, and one
   the model drops after the segment ends is gone by the segment's backward
   (``remat.plan.segments.held_in_forward``).
On a loop that holds BLOOM-like attention probabilities (``keep`` saves them, ``recompute`` does
not; tests/test_handovers.py), held to the next block, to the head or only the last: all 72 plans of
one segment and random options around it measured their prediction to the byte, and of 87 random
plans of nested and several segments on six blocks, 74 did and none measured over. Read as kept in
the forward too (before), 0 of 48 and 15 of 87 were exact; read as recomputed in the replay too, 19
of 24 measured over it (up to 72 KiB). The replay's ``keep`` numbers hold a handover's graph (NOTE
[ A handover's graph ] in remat.measure.handovers) to the block's backward, on the safe side: on a
loop of gathered caches, 18 one-segment plans measured up to 96 KiB under their prediction, none over.

# NOTE [ A segment over where a handover dies ]
A segment's replay reads its blocks' ``keep`` numbers, which carry the model's code dropping a
handover made before (the loop's previous attention weights, which ``keep`` does not save), where
the forward's count has let it go already, or the replay's own calls hold it otherwise: ESM-2's
layers return their head-averaged attention weights, and one-block segments measured 263,736 B over
their prediction per pair of adjacent ones, a two-block segment 1,048,576 B (the weights' size),
nested ones starting before such a block up to 67,272 B (tests/test_segment_plans_fit.py). Read
term by term it came out exact for flat segments, but not for nested ones nor a Swin stage whose
stash the code's frees outweigh (helper 24). So no segment holds a block in whose forward the
model's code drops a handover ``keep`` does not save (``SegmentModel.reach``); those blocks are
planned per block, and a segment that only makes such a handover stays (``gone``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from remat.errors import InvalidValue
from remat.plan.chain import ChainConstraints
from remat.plan.costmodel import estimate, overhead
from remat.plan.handovers import handed_over, handovers
from remat.plan.segments import SegmentModel, Tree, forest, held_in_forward
from remat.records import Estimate, Profile

__all__ = ["estimate_segments"]


def estimate_segments(
    profile: Profile, choices: Mapping[str, str], segments: Sequence[Sequence[str]]
) -> Estimate:
    """``remat.plan.costmodel.estimate`` for a plan with segments (``Plan.segments``: pairs of
    block names); without segments, exactly ``estimate``."""
    if not segments:
        return estimate(profile, choices)
    estimate(profile, choices)  # validates the choices
    index = {b.name: i for i, b in enumerate(profile.blocks)}
    spans = []
    for seg in segments:
        if len(seg) != 2 or any(n not in index for n in seg):
            raise InvalidValue(f"segment {list(seg)!r} is not a [first, last] pair of block names of this profile")
        spans.append((index[seg[0]], index[seg[1]]))
    trees = forest(spans, len(profile.blocks))
    inside = {j for t in trees for j in range(t.span[0], t.span[1] + 1)}
    for j in sorted(inside):
        if choices[profile.blocks[j].name] != "keep":
            raise InvalidValue(f"block {profile.blocks[j].name!r} is inside a segment; its choice must be 'keep'")
    replayed, handed = None, []
    if handovers(profile):  # NOTE [ Handovers in a segment ]
        first = ["recompute" if j in inside else choices[b.name] for j, b in enumerate(profile.blocks)]
        replayed, handed = profile, held_in_forward(profile, first)
        profile = handed_over(profile, first)
    m = SegmentModel(profile, replayed=replayed, handed=handed)
    chain = m.chain
    starts = {t.span[0]: t for t in trees}
    col = {o: c for c, o in enumerate(chain.options)}
    peak, where = chain.fixed_bytes, "the embeddings or the optimizer step"
    prefix = held = 0
    extra_ms = 0.0
    i = 0
    while i < m.n:
        tree = starts.get(i)
        if tree is None:
            o = col[choices[profile.blocks[i].name]]
            held |= chain.holds[i][o] if chain.holds else 0
            value = prefix + chain.need_at(i, o, held)
            if value > peak:
                peak, where = value, _per_block_where(chain, profile, i, o, held)
            prefix += chain.kept_bytes[i][o]
            extra_ms += chain.extra_ms[i][o]
            i += 1
            continue
        s, e = tree.span
        need, _, at = m.need(tree, held)
        held |= m.holds(s, e)
        if prefix + need > peak:
            peak, where = prefix + need, at
        prefix += m.kept(s, e)
        extra_ms += _replay_ms(m, tree) + sum(chain.extra_ms[j][col["keep"]] for j in range(s, e + 1))
        i = e + 1
    tail = prefix + chain.tail_at(held)
    if tail > peak:
        peak, where = tail, "forward or backward of the head"
    step_ms = profile.plain_step_ms + extra_ms
    return Estimate(peak_bytes=peak, peak_phase=where, step_ms=step_ms, overhead=overhead(profile, step_ms))


def _per_block_where(chain: ChainConstraints, profile: Profile, i: int, o: int, held: int) -> str:
    if not chain.holds:
        return f"forward or backward of {profile.blocks[i].name}"
    fwd = chain.fwd_need_bytes[i][o]
    stage = "forward" if fwd >= chain.need_at(i, o, held) else "backward"
    return f"{stage} of {profile.blocks[i].name}"


def _replay_ms(m: SegmentModel, tree: Tree) -> float:
    """The extra milliseconds of a segment's replays (as ``_replay`` counts ticks)."""
    s, e = tree.span
    covered = {j for c in tree.children for j in range(c.span[0], c.span[1] + 1)}
    ms = sum(m.ms[j] for j in range(s, e + 1) if j not in covered)
    for c in tree.children:
        if c.span[1] < e:
            ms += sum(m.ms[c.span[0] : c.span[1] + 1])
        ms += _replay_ms(m, c)
    return ms
