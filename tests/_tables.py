"""Hand-built profiles for the cost model and solver tests, and a brute force to check them by."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from hypothesis import strategies as st

from remat.crossing import Crossing
from remat.plan.chain import chain_constraints
from remat.records import BlockProfile, OptionCost, Profile, Segment
from remat.vocabulary import OPTIONS


def cost(kept: int, *, fwd: int = 0, bwd: int = 0, ms: float = 0.0) -> OptionCost:
    return OptionCost(kept_bytes=kept, fwd_peak_bytes=fwd, bwd_peak_bytes=bwd, extra_ms=ms)


def block(name: str, grad: int = 0, **options: OptionCost) -> BlockProfile:
    return BlockProfile(
        name=name,
        kind="Block",
        param_bytes=grad,
        grad_bytes=grad,
        input_bytes=1,
        fwd_ms=1.0,
        bwd_ms=2.0,
        options=dict(options),
    )


def segment(kept: int = 0, *, fwd: int = 0, bwd: int = 0, grad: int = 0) -> Segment:
    return Segment(
        kept_bytes=kept,
        fwd_peak_bytes=fwd,
        bwd_peak_bytes=bwd,
        grad_bytes=grad,
        fwd_ms=1.0,
        bwd_ms=1.0,
    )


def profile(
    blocks: Sequence[BlockProfile],
    *,
    base: int = 0,
    params: int = 0,
    optimizer: int = 0,
    batch: int = 0,
    pre: Segment | None = None,
    post: Segment | None = None,
    optimizer_peak: int = 0,
    gather: int = 0,
    plain_step_ms: float = 100.0,
    plain_peak: int = 1000,
    device: str = "cuda",
    crossings: Sequence[Crossing] = (),
    post_fwd_held: int = 0,
) -> Profile:
    return Profile(
        model="Chain",
        fingerprint="f" * 16,
        device=device,
        mode="measured",
        dtype="float32",
        batch_shape=[2, 8],
        base_bytes=base,
        param_bytes=params,
        optimizer_bytes=optimizer,
        batch_bytes=batch,
        optimizer_peak_bytes=optimizer_peak,
        pre=pre or segment(),
        post=post or segment(),
        blocks=list(blocks),
        plain_peak_bytes=plain_peak,
        plain_step_ms=plain_step_ms,
        gather_bytes=gather,
        crossings=list(crossings),
        post_fwd_peak_held_bytes=post_fwd_held,
    )


@dataclass(frozen=True)
class Brute:
    """Every assignment of the profile's common options: option indices, peaks, extra times."""

    options: tuple[str, ...]
    picks: np.ndarray  # (assignments, blocks)
    peak_bytes: np.ndarray  # (assignments,)
    extra_ms: np.ndarray  # (assignments,), summed in block order

    def fastest_within(self, budget: int) -> tuple[float, int] | None:
        """(least extra time, lowest peak at that time) over assignments that fit, or None."""
        fits = self.peak_bytes <= budget
        if not fits.any():
            return None
        best = self.extra_ms[fits].min()
        return float(best), int(self.peak_bytes[fits & (self.extra_ms == best)].min())

    def pareto(self) -> set[tuple[int, float]]:
        """The (peak, extra time) pairs no other assignment beats in both."""
        points = sorted(set(zip(self.peak_bytes.tolist(), self.extra_ms.tolist())))
        front, best_ms = set(), float("inf")
        for peak, ms in points:
            if ms < best_ms:
                front.add((peak, ms))
                best_ms = ms
        return front


def budget_near(data: st.DataObject, brute: Brute) -> int:
    """A budget drawn from just below the lowest peak to just above the highest."""
    low, high = int(brute.peak_bytes.min()), int(brute.peak_bytes.max())
    return max(1, data.draw(st.integers(low - 2, high + 2)))


def brute_force(p: Profile) -> Brute:
    """All assignments, vectorised; the peak comes from the prefix-sum form, which
    test_costmodel checks against ``estimate``."""
    chain = chain_constraints(p)
    n, width = len(p.blocks), len(chain.options)
    # Row r spells r in base ``width``, most significant digit first: itertools.product's order.
    powers = width ** np.arange(n - 1, -1, -1, dtype=np.int64)
    picks = np.arange(width**n, dtype=np.int64)[:, None] // powers % width
    kept = np.array(chain.kept_bytes, dtype=np.int64).reshape(n, width)
    need = np.array(chain.need_bytes, dtype=np.int64).reshape(n, width)
    ms = np.array(chain.extra_ms, dtype=np.float64).reshape(n, width)
    if chain.holds:  # side inputs: the state-carrying form, one assignment at a time
        peaks = np.array([chain.peak_bytes(row) for row in picks.tolist()], dtype=np.int64)
        extra = np.zeros(len(picks))
        for i in range(n):
            extra = extra + ms[i, picks[:, i]]
        return Brute(options=chain.options, picks=picks, peak_bytes=peaks, extra_ms=extra)
    cols = np.arange(n)
    k = kept[cols, picks]
    before = np.cumsum(k, axis=1) - k
    peak = np.maximum(
        (before + need[cols, picks]).max(axis=1, initial=chain.fixed_bytes),
        k.sum(axis=1) + chain.tail_bytes,
    )
    extra = np.zeros(len(picks))
    for i in range(n):
        extra = extra + ms[i, picks[:, i]]
    return Brute(options=chain.options, picks=picks, peak_bytes=peak, extra_ms=extra)


# --- random chains -----------------------------------------------------------------------------


@st.composite
def chains(
    draw: st.DrawFn, max_blocks: int = 6, max_blocks_3: int | None = None, sides: bool = False,
    compiled: bool = False, handovers: bool = False,
) -> Profile:
    """Random chains with 3 options (up to ``max_blocks_3`` blocks) or all 5 (up to ``max_blocks``).

    Hypothesis draws the shape (options, blocks, scale) and a seed for the numbers: drawing each
    of a hundred numbers through hypothesis made the properties ten times slower. Bytes are small
    numbers (0..64) times a scale of 1 byte or about a MiB, so that ties and budgets right at a
    peak are common, and large counts exercise the solvers' rounding. Times are multiples of
    1/4 ms, exact in floating point, so equal times are exactly equal. With ``sides``, one to
    three side inputs enter random subsets of the blocks, some saved by some of them. With
    ``compiled``, every block also offers ``compiled:0.5`` and ``compiled:0.2``, whose extra
    times may be negative (compiled code can beat the eager block's). With ``handovers``, one to
    four handovers, each made by a random block and dying in a later block's forward or the head's,
    saved by a random set of the runs (NOTE [ Tensors that cross a block boundary ] in remat.crossing)."""
    options = draw(st.sampled_from([("keep", "selective", "recompute"), OPTIONS]))
    if compiled:
        options = (*options, "compiled:0.5", "compiled:0.2")
    top = max_blocks if len(options) >= len(OPTIONS) or max_blocks_3 is None else max_blocks_3
    n = draw(st.integers(0, top))
    scale = draw(st.sampled_from([1, 1, 2**20 + 3]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))

    def nbytes() -> int:
        return int(rng.integers(0, 65)) * scale + int(rng.integers(0, scale))

    def seg() -> Segment:
        return segment(nbytes(), fwd=nbytes(), bwd=nbytes(), grad=nbytes())

    blocks = [
        block(
            f"layers.{i}",
            grad=nbytes(),
            **{
                o: cost(nbytes(), fwd=nbytes(), bwd=nbytes(),
                        ms=int(rng.integers(-20 if o.startswith("compiled") else 0, 41)) / 4)
                for o in options
            },
        )
        for i in range(n)
    ]
    base, pre, post = int(rng.integers(1, 201)) * scale, seg(), seg()
    optimizer_peak, gather = nbytes(), int(rng.integers(0, 9)) * scale
    side_inputs: list[Crossing] = []
    if sides and n:
        for _ in range(int(rng.integers(1, 4))):
            users = [b.name for b in blocks if rng.random() < 0.7] or [blocks[-1].name]
            savers = [u for u in users if rng.random() < 0.3]
            # unsaved, it may die in the forward of its last consumer or of a block after it
            # (NOTE [ Where a side input dies ])
            last = [b.name for b in blocks].index(users[-1])
            dies = None
            if not savers and rng.random() < 0.5:
                dies = blocks[int(rng.integers(last, n))].name
            side_inputs.append(
                Crossing(size_bytes=nbytes(), consumers=users, saved_by={s: ["keep"] for s in savers},
                         dies_after=dies)
            )
    held = post.fwd_peak_bytes + int(rng.integers(0, 1 + sum(s.size_bytes for s in side_inputs)))
    handed: list[Crossing] = []
    if handovers and n:
        runs = [o for o in options if o in ("keep", "selective", "recompute") or o.startswith("compiled")]
        for _ in range(int(rng.integers(1, 5))):
            maker = int(rng.integers(0, n))
            dies = int(rng.integers(maker + 1, n + 1))  # n: the head
            saved_by = [o for o in runs if rng.random() < 0.5]
            handed.append(Crossing(size_bytes=nbytes(), made_by=blocks[maker].name,
                                   dies_after=blocks[dies].name if dies < n else None,
                                   saved_by={blocks[maker].name: saved_by} if saved_by else {}))
    # what a kept backward holds when it first reads a saved tensor (BlockProfile.unpack_bytes),
    # drawn last so that the numbers above stay those of the seed
    blocks = [dataclasses.replace(b, unpack_bytes=nbytes() if rng.random() < 0.5 else 0) for b in blocks]
    # what a replay snapshots (BlockProfile.stats_bytes), and blocks that save nothing, whose
    # checkpoint holds no side input (BlockProfile.saves)
    blocks = [dataclasses.replace(b, stats_bytes=nbytes() if rng.random() < 0.3 else 0, saves=rng.random() < 0.8)
              for b in blocks]
    # what a kept maker's forward saved for a handover's graph alone (NOTE [ A handover's graph ]),
    # drawn last too
    handed = [dataclasses.replace(h, graph_bytes=nbytes() if rng.random() < 0.5 else 0) for h in handed]
    p = profile(
        blocks, base=base, pre=pre, post=post, optimizer_peak=optimizer_peak, gather=gather,
        crossings=[*side_inputs, *handed], post_fwd_held=held if side_inputs else post.fwd_peak_bytes,
    )  # fmt: skip
    return p


def varied_chain(n: int, seed: int, offload: bool = False) -> Profile:
    """A chain too long for brute force: every number of every block drawn around a decoder
    layer's, with (a GPU's) or without (a CPU's) the offload options. On a CPU's, segments win at
    tight budgets; from a few dozen blocks the per-block search needs its bounds (NOTE [ Bounding
    the search ])."""
    rng = random.Random(seed)

    def r(x: float) -> int:
        return int(x * rng.uniform(0.7, 1.4))

    blocks = []
    for i in range(n):
        options = {"keep": cost(r(400), fwd=r(200), bwd=r(300)),
                   "selective": cost(r(150), fwd=r(200), bwd=r(350), ms=rng.choice([1.0, 1.25, 1.5])),
                   "recompute": cost(32, fwd=r(200), bwd=r(650), ms=rng.choice([5.0, 6.0, 6.5]))}
        if offload:
            options |= {"offload": cost(0, fwd=r(220), bwd=r(700), ms=2.5),
                        "recompute_offload": cost(0, fwd=r(200), bwd=r(690), ms=7.0)}
        blocks.append(dataclasses.replace(block(f"layers.{i}", grad=r(50), **options), input_bytes=32))
    return profile(blocks, base=150 * n, plain_peak=10**9)
