"""The one cost model: a step's peak bytes and time for one assignment of options to blocks.

``estimate`` replays one training step phase by phase and tracks the bytes live on the device;
every solver and ``verify`` use it, so "fits the budget" means one thing everywhere.
``chain_constraints`` rewrites the same arithmetic as prefix-sum constraints, the form the solvers
search (NOTE [ Every peak candidate is a prefix sum ]); ``smallest_feasible`` is the lowest peak any
assignment reaches. Pure numbers: no torch, no numpy, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from remat.errors import InvalidType, InvalidValue, did_you_mean
from remat.plan.handovers import handed_over
from remat.plan.schedule import Phase, step_phases
from remat.plan.sides import side_groups
from remat.records import OPTIONS, Estimate, OptionCost, Profile
from remat.units import format_bytes

__all__ = ["ChainConstraints", "chain_constraints", "estimate", "smallest_feasible"]


def estimate(profile: Profile, choices: Mapping[str, str]) -> Estimate:
    """Predict the peak bytes and step time of ``profile``'s step with ``choices`` applied.

    ``choices`` maps every block name to one of the options that block offers.
    """
    costs = _chosen_costs(profile, choices)
    options = [choices[b.name] for b in profile.blocks]
    if profile.handovers:  # NOTE [ Handovers ] in remat.records
        costs = _chosen_costs(profile := handed_over(profile, options), choices)
    phases = _phases(profile, costs, options)
    peak = max(phases, key=lambda p: p.peak_bytes)  # max() keeps the first phase reaching it
    step_ms = profile.plain_step_ms + sum(c.extra_ms for c in costs)
    overhead = step_ms / profile.plain_step_ms - 1.0 if profile.plain_step_ms else 0.0
    return Estimate(
        peak_bytes=peak.peak_bytes, peak_phase=peak.name, step_ms=step_ms, overhead=overhead
    )


# --- the simulation ----------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class _Phase:
    """One phase of the step and the bytes live at its peak, split by what holds them."""

    name: str
    base_bytes: int
    """Parameters, optimizer state, batch: live through the whole step."""
    activation_bytes: int
    """Activations kept for the backward, live when the phase starts."""
    grad_bytes: int
    """Gradients produced so far, live when the phase starts."""
    transient_bytes: int
    """The phase's own peak above the level it started at."""
    transient: str
    """What the transient bytes are, for people."""

    @property
    def peak_bytes(self) -> int:
        return self.base_bytes + self.activation_bytes + self.grad_bytes + self.transient_bytes


def _phases(profile: Profile, costs: Sequence[OptionCost], options: Sequence[str]) -> list[_Phase]:
    """Replay one step (NOTE [ The step's schedule ]); ``costs`` is one option per block, named by
    ``options``. Side inputs live as the plan makes them (NOTE [ A side input's extra life ])."""
    names = [b.name for b in profile.blocks]
    sides = side_groups(profile)
    held = [0] * len(costs)  # the groups held at each block's backward: those held up to it
    for i, option in enumerate(options):
        held[i] = (held[i - 1] if i else 0) | sides.holds(i, option)
    last = held[-1] if held else 0
    phases: list[_Phase] = []
    acts = grads = 0
    for phase in step_phases(len(costs)):
        kept, transient, grad = _numbers(profile, costs, phase)
        extra = 0
        if phase.part == "block":
            assert phase.block is not None
            added = sides.delta_bytes if phase.stage == "backward" else sides.fwd_delta_bytes
            extra = added(held[phase.block], phase.block)
        elif phase.stage == "backward" and phase.part == "post":
            extra = sides.delta_bytes(last, None)
        elif phase.stage == "forward" and phase.part == "post":
            transient += sides.post_fwd_extra_bytes(last)
        phases.append(
            _Phase(
                name=phase.title(names),
                base_bytes=profile.base_bytes,
                activation_bytes=acts + extra,
                grad_bytes=grads,
                transient_bytes=transient,
                transient=phase.working_memory(names),
            )
        )
        if phase.stage == "forward":
            acts += kept
        elif phase.stage == "backward":
            acts -= kept
            grads += grad
    assert acts == 0, f"activations left after the backward: {acts} bytes"
    return phases


def _numbers(profile: Profile, costs: Sequence[OptionCost], phase: Phase) -> tuple[int, int, int]:
    """(kept, transient, gradient) bytes of the part ``phase`` runs, in that phase."""
    if phase.part == "optimizer":
        return 0, profile.optimizer_peak_bytes, 0
    if phase.block is not None:
        cost, gather = costs[phase.block], profile.gather_bytes
        peak = cost.fwd_peak_bytes if phase.stage == "forward" else cost.bwd_peak_bytes
        return cost.kept_bytes, peak + gather, profile.blocks[phase.block].grad_bytes
    seg = profile.pre if phase.part == "pre" else profile.post
    peak = seg.fwd_peak_bytes if phase.stage == "forward" else seg.bwd_peak_bytes
    return seg.kept_bytes, peak, seg.grad_bytes


def _chosen_costs(profile: Profile, choices: Mapping[str, str]) -> list[OptionCost]:
    """Validate ``choices`` against the profile and return the chosen cost of each block, in order."""
    if not isinstance(choices, Mapping):
        raise InvalidType(
            f"expected choices as a mapping of block name -> option, got {type(choices).__name__}"
        )
    names = [b.name for b in profile.blocks]
    known = set(names)
    for name in choices:
        if name not in known:
            raise InvalidValue(
                f"choices name block {name!r}, which is not in this profile of {profile.model}; "
                f"expected one of its {len(names)} blocks ({_preview(names)})"
                f"{did_you_mean(name, names)}"
            )
    missing = [n for n in names if n not in choices]
    if missing:
        raise InvalidValue(
            f"choices give no option for {len(missing)} of {len(names)} blocks "
            f"({_preview(missing)}); expected one option per block, e.g. {{{missing[0]!r}: 'keep'}}"
        )
    costs = []
    for block in profile.blocks:
        option = choices[block.name]
        cost = block.options.get(option)
        if cost is None:
            offered = [o for o in OPTIONS if o in block.options] + sorted(set(block.options) - set(OPTIONS))
            where = f" on device {profile.device!r}" if option in OPTIONS else ""
            raise InvalidValue(
                f"block {block.name!r} does not offer option {option!r}{where}; expected one of "
                f"{offered}{did_you_mean(str(option), offered)}"
            )
        costs.append(cost)
    return costs


def _preview(names: Sequence[str], limit: int = 4) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")


# --- the same arithmetic as prefix-sum constraints ---------------------------------------------

# NOTE [ Every peak candidate is a prefix sum ]
# Write K_i for the bytes kept by blocks 1..i under some assignment (K_0 = 0), c_i for block i's
# chosen option, lead = base + pre.kept, and G_{>i} for the grad_bytes of the blocks after i.
# Replaying ``_phases`` gives each candidate as a constant plus K of some prefix:
#   forward of block i   lead + K_{i-1} + fwd_peak(c_i) + gather
#   backward of block i  lead + post.grad + G_{>i} + K_i + bwd_peak(c_i) + gather,
#                        because the backward frees what blocks i+1..n kept and adds their grads;
#                        K_i = K_{i-1} + kept(c_i), so this too is K_{i-1} + a term of (i, c_i)
#   forward/backward of the head   lead + K_n + post.fwd_peak, resp. + post.kept + post.bwd_peak
#   embeddings, optimizer step     constants: everything the blocks kept is freed by then
# So  peak = max(fixed, max_i (K_{i-1} + need_i(c_i)), K_n + tail),  with need_i the larger of the
# block's two terms. Every constraint "peak <= budget" is a bound on a prefix sum: smaller prefixes
# are always at least as good, which is what lets the solvers keep, per prefix, only the states
# that are not dominated, and lets ``suffix_floor_bytes`` compute the lowest peak in one pass.
# tests/test_costmodel.py checks this form against ``estimate`` on random chains.


@dataclass(frozen=True, kw_only=True)
class ChainConstraints:
    """A profile's peak as prefix-sum constraints, per block and option (see NOTE [ Every peak
    candidate is a prefix sum ]). Rows are blocks in forward order, columns are ``options``."""

    options: tuple[str, ...]
    """The options the columns stand for, in ``OPTIONS`` order."""
    kept_bytes: tuple[tuple[int, ...], ...]
    """[block][option]: bytes the block keeps from its forward until its backward."""
    need_bytes: tuple[tuple[int, ...], ...]
    """[block][option]: the block's higher peak candidate (forward or backward) minus the bytes
    kept by the blocks before it."""
    extra_ms: tuple[tuple[float, ...], ...]
    """[block][option]: extra step time of the option, milliseconds."""
    tail_bytes: int
    """The head's higher peak candidate minus the bytes kept by all the blocks."""
    fixed_bytes: int
    """The highest candidate no choice changes (embeddings' forward and backward, optimizer)."""
    holds: tuple[tuple[int, ...], ...] = ()
    """With side inputs (NOTE [ A side input's extra life ]), else empty. [block][option]: the
    side-input groups the option holds, a mask; the state after block i is the union up to it."""
    fwd_need_bytes: tuple[tuple[int, ...], ...] = ()
    """[block][option]: the forward's candidate minus the prefix (side inputs do not change it)."""
    bwd_need_bytes: tuple[tuple[int, ...], ...] = ()
    """[block][option]: the backward's candidate minus the prefix, side inputs as the plain step."""
    delta_bytes: tuple[tuple[int, ...], ...] = ()
    """[block][state]: bytes the held side inputs add to the block's backward."""
    tail_held_bytes: tuple[int, ...] = ()
    """[state]: the head's candidate minus all kept bytes, with that state at the end."""
    fwd_delta_bytes: tuple[tuple[int, ...], ...] = ()
    """[block][state]: bytes held side inputs add to its forward (NOTE [ Where a side input dies ])."""

    def need_at(self, i: int, o: int, held: int) -> int:
        """Block i's candidate with option o, minus the prefix, in state ``held`` (which includes
        the option's own holds)."""
        if not self.holds:
            return self.need_bytes[i][o]
        return max(
            self.fwd_need_bytes[i][o] + self.fwd_delta_bytes[i][held],
            self.bwd_need_bytes[i][o] + self.delta_bytes[i][held],
        )

    def tail_at(self, held: int) -> int:
        return self.tail_held_bytes[held] if self.holds else self.tail_bytes

    def peak_bytes(self, picks: Sequence[int]) -> int:
        """The peak for one option index per block; equals ``estimate(...).peak_bytes``."""
        assert len(picks) == len(self.kept_bytes)
        peak, prefix, held = self.fixed_bytes, 0, 0
        for i, (kept, o) in enumerate(zip(self.kept_bytes, picks)):
            held |= self.holds[i][o] if self.holds else 0
            peak = max(peak, prefix + self.need_at(i, o, held))
            prefix += kept[o]
        return max(peak, prefix + self.tail_at(held))

    def suffix_floor_bytes(self) -> list[int]:
        """``floors[i]``: the lowest peak blocks i.. and the head can reach with nothing kept before
        block i (and no side input held). A prefix K before block i can still meet budget B only
        if K + floors[i] <= B, since every candidate from there on is K plus a term that holding
        more side inputs never lowers: floors[i] = min over options of max(need_i, kept_i +
        floors[i+1]), and floors[n] = tail. Exact for i = 0."""
        return [row[0] for row in self.suffix_floors()]

    def suffix_floors(self) -> list[list[int]]:
        """[i][state]: ``suffix_floor_bytes`` entering block i in that side-input state."""
        states = len(self.tail_held_bytes) if self.holds else 1
        floors = [[self.tail_at(h) for h in range(states)]]
        for i in range(len(self.kept_bytes) - 1, -1, -1):
            after = floors[-1]
            row = []
            for h in range(states):
                best = None
                for o, k in enumerate(self.kept_bytes[i]):
                    now = h | (self.holds[i][o] if self.holds else 0)
                    value = max(self.need_at(i, o, now), k + after[now])
                    best = value if best is None else min(best, value)
                assert best is not None
                row.append(best)
            floors.append(row)
        floors.reverse()
        return floors


def chain_constraints(profile: Profile, options: Sequence[str] | None = None) -> ChainConstraints:
    """``profile`` as prefix-sum constraints over ``options`` (default: those every block offers)."""
    offered = profile.options
    if options is None:
        options = offered
    not_offered = [o for o in options if o not in offered]
    if not_offered:
        raise InvalidValue(
            f"options {not_offered} are not offered by every block of this profile; expected a "
            f"subset of {list(offered)}{did_you_mean(str(not_offered[0]), offered)}"
        )
    if profile.blocks and not options:
        raise InvalidValue(
            f"the blocks of this {profile.model} profile have no option in common (each offers "
            f"some of {list(OPTIONS)}); re-profile it so that every block offers at least 'keep'"
        )
    names = [b.name for b in profile.blocks]
    if len(set(names)) != len(names):
        duplicate = next(n for n in names if names.count(n) > 1)
        raise InvalidValue(
            f"block name {duplicate!r} appears twice in this profile; expected unique names"
        )
    options = tuple(o for o in OPTIONS if o in options) + tuple(
        o for o in options if o not in OPTIONS
    )
    for block in profile.blocks:
        for o in options:
            if not math.isfinite(block.options[o].extra_ms):
                raise InvalidValue(
                    f"block {block.name!r} option {o!r} has extra_ms={block.options[o].extra_ms}; "
                    "expected a finite number of milliseconds (re-profile the model)"
                )
    columns = [[b.options[o] for b in profile.blocks] for o in options]
    fwds, bwds, (tail_fwd, tail_bwd), fixed = _prefix_terms(profile, columns)
    n = len(profile.blocks)
    needs = [[max(f, b) for f, b in zip(fr, br)] for fr, br in zip(fwds, bwds)]
    sides = side_groups(profile)
    kept = tuple(tuple(c[i].kept_bytes for c in columns) for i in range(n))
    extra_ms = tuple(tuple(c[i].extra_ms for c in columns) for i in range(n))
    if not profile.side_inputs:
        return ChainConstraints(
            options=options, kept_bytes=kept, need_bytes=tuple(tuple(r) for r in needs),
            extra_ms=extra_ms, tail_bytes=max(tail_fwd, tail_bwd), fixed_bytes=fixed,
        )  # fmt: skip
    holds, delta, fwd_delta, tails, low = sides.tables(options, fwds, bwds, tail_fwd, tail_bwd)
    return ChainConstraints(
        options=options, kept_bytes=kept, need_bytes=low, extra_ms=extra_ms, tail_bytes=tails[0],
        fixed_bytes=fixed, holds=holds, fwd_need_bytes=tuple(tuple(r) for r in fwds),
        bwd_need_bytes=tuple(tuple(r) for r in bwds), delta_bytes=delta, tail_held_bytes=tails,
        fwd_delta_bytes=fwd_delta,
    )  # fmt: skip


def _prefix_terms(
    profile: Profile, columns: Sequence[Sequence[OptionCost]]
) -> tuple[list[list[int]], list[list[int]], tuple[int, int], int]:
    """Replay the step (NOTE [ The step's schedule ]) with the blocks' kept bytes left out, as
    NOTE [ Every peak candidate is a prefix sum ] writes it: per block and option column the
    forward and backward candidates minus the prefix kept before it, the head's two (minus all
    blocks' kept bytes), and the highest candidate no choice changes."""
    n = len(profile.blocks)
    needs: list[list[int]] = [[] for _ in range(n)]
    bwds: list[list[int]] = [[] for _ in range(n)]
    tails: list[int] = []
    fixed: list[int] = []
    acts = grads = 0  # live bytes outside what the blocks keep
    for phase in step_phases(n):
        level = profile.base_bytes + acts + grads
        if phase.block is not None:
            terms = []
            for costs in columns:
                kept, transient, _ = _numbers(profile, costs, phase)
                own = kept if phase.stage == "backward" else 0  # its backward: its own kept too
                terms.append(level + own + transient)
            (bwds if phase.stage == "backward" else needs)[phase.block] = terms
            if phase.stage == "backward":
                grads += profile.blocks[phase.block].grad_bytes
            continue
        kept, transient, grad = _numbers(profile, [], phase)
        (tails if phase.part == "post" else fixed).append(level + transient)
        if phase.stage == "forward":
            acts += kept
        elif phase.stage == "backward":
            acts, grads = acts - kept, grads + grad
    assert len(tails) == 2, "the head runs a forward and a backward"
    return needs, bwds, (tails[0], tails[1]), max(fixed)


# --- the floor ---------------------------------------------------------------------------------


def smallest_feasible(profile: Profile) -> tuple[int, str]:
    """The lowest peak any assignment of the common options reaches, and what dominates it, e.g.
    ``(2_900_000_000, "parameters and optimizer state take 2.10 GiB")``."""
    chain = chain_constraints(profile)
    floors = chain.suffix_floors()  # [i][side-input state]
    peak = max(chain.fixed_bytes, floors[0][0])
    # One assignment that reaches it, the cheapest option at each step that keeps the rest feasible.
    picks, prefix, held = [], 0, 0
    for i, (kept, ms) in enumerate(zip(chain.kept_bytes, chain.extra_ms)):
        now = [held | (chain.holds[i][o] if chain.holds else 0) for o in range(len(kept))]
        fits = [
            o
            for o in range(len(chain.options))
            if prefix + chain.need_at(i, o, now[o]) <= peak
            and prefix + kept[o] + floors[i + 1][now[o]] <= peak
        ]
        o = min(fits, key=lambda o: (ms[o], o))
        picks.append(o)
        prefix, held = prefix + kept[o], now[o]
    names = [chain.options[o] for o in picks]
    costs = [b.options[name] for b, name in zip(profile.blocks, names)]
    top = max(_phases(profile, costs, names), key=lambda p: p.peak_bytes)
    assert top.peak_bytes == peak, (top.peak_bytes, peak)
    return peak, _dominant(profile, top)


def _dominant(profile: Profile, phase: _Phase) -> str:
    """The largest single thing live at ``phase``'s peak, as a phrase for people."""
    state = profile.param_bytes + profile.optimizer_bytes
    parts = [
        (
            "parameters and optimizer state take" if profile.optimizer_bytes else "parameters take",
            min(state, phase.base_bytes),
        ),
        ("the batch takes", profile.batch_bytes),
        (
            "other memory live through the step takes",
            phase.base_bytes - state - profile.batch_bytes,
        ),
        ("activations kept for the backward take", phase.activation_bytes),
        ("gradients take", phase.grad_bytes),
        (f"{phase.transient} takes", phase.transient_bytes),
    ]
    what, size = max(parts, key=lambda p: p[1])
    return f"{what} {format_bytes(size)}"
