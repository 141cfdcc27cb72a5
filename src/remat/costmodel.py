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

from remat.errors import did_you_mean
from remat.records import OPTIONS, Estimate, OptionCost, Profile
from remat.units import format_bytes

__all__ = ["ChainConstraints", "chain_constraints", "estimate", "smallest_feasible"]


def estimate(profile: Profile, choices: Mapping[str, str]) -> Estimate:
    """Predict the peak bytes and step time of ``profile``'s step with ``choices`` applied.

    ``choices`` maps every block name to one of the options that block offers.
    """
    costs = _chosen_costs(profile, choices)
    phases = _phases(profile, costs)
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


def _phases(profile: Profile, costs: Sequence[OptionCost]) -> list[_Phase]:
    """Replay one step: forward, backward, optimizer step. ``costs`` is one option per block."""
    pre, post, gather = profile.pre, profile.post, profile.gather_bytes
    phases: list[_Phase] = []
    acts = grads = 0

    def at(name: str, transient_bytes: int, transient: str) -> None:
        phases.append(
            _Phase(
                name=name,
                base_bytes=profile.base_bytes,
                activation_bytes=acts,
                grad_bytes=grads,
                transient_bytes=transient_bytes,
                transient=transient,
            )
        )

    at("forward of the embeddings", pre.fwd_peak_bytes, "the embeddings' forward working memory")
    acts += pre.kept_bytes
    for block, cost in zip(profile.blocks, costs):
        at(
            f"forward of {block.name}",
            cost.fwd_peak_bytes + gather,
            f"block {block.name}'s forward working memory",
        )
        acts += cost.kept_bytes
    at(
        "forward of the head",
        post.fwd_peak_bytes,
        "the head's forward working memory (logits, loss)",
    )
    acts += post.kept_bytes
    at("backward of the head", post.bwd_peak_bytes, "the head's backward working memory")
    acts -= post.kept_bytes
    grads += post.grad_bytes
    for block, cost in zip(reversed(profile.blocks), reversed(costs)):
        at(
            f"backward of {block.name}",
            cost.bwd_peak_bytes + gather,
            f"block {block.name}'s backward working memory",
        )
        acts -= cost.kept_bytes
        grads += block.grad_bytes
    at("backward of the embeddings", pre.bwd_peak_bytes, "the embeddings' backward working memory")
    acts -= pre.kept_bytes
    grads += pre.grad_bytes
    assert acts == 0, f"activations left after the backward: {acts} bytes"
    at("optimizer step", profile.optimizer_peak_bytes, "the optimizer step's working memory")
    return phases


def _chosen_costs(profile: Profile, choices: Mapping[str, str]) -> list[OptionCost]:
    """Validate ``choices`` against the profile and return the chosen cost of each block, in order."""
    if not isinstance(choices, Mapping):
        raise TypeError(
            f"expected choices as a mapping of block name -> option, got {type(choices).__name__}"
        )
    names = [b.name for b in profile.blocks]
    known = set(names)
    for name in choices:
        if name not in known:
            raise ValueError(
                f"choices name block {name!r}, which is not in this profile of {profile.model}; "
                f"expected one of its {len(names)} blocks ({_preview(names)})"
                f"{_did_you_mean(name, names)}"
            )
    missing = [n for n in names if n not in choices]
    if missing:
        raise ValueError(
            f"choices give no option for {len(missing)} of {len(names)} blocks "
            f"({_preview(missing)}); expected one option per block, e.g. {{{missing[0]!r}: 'keep'}}"
        )
    costs = []
    for block in profile.blocks:
        option = choices[block.name]
        cost = block.options.get(option)
        if cost is None:
            offered = [o for o in OPTIONS if o in block.options] + sorted(
                set(block.options) - set(OPTIONS)
            )
            where = f" on device {profile.device!r}" if option in OPTIONS else ""
            raise ValueError(
                f"block {block.name!r} does not offer option {option!r}{where}; expected one of "
                f"{offered}{_did_you_mean(str(option), offered)}"
            )
        costs.append(cost)
    return costs


def _did_you_mean(word: str, candidates: Sequence[str]) -> str:
    return did_you_mean(word, candidates)


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

    def peak_bytes(self, picks: Sequence[int]) -> int:
        """The peak for one option index per block; equals ``estimate(...).peak_bytes``."""
        assert len(picks) == len(self.kept_bytes)
        peak, prefix = self.fixed_bytes, 0
        for kept, need, o in zip(self.kept_bytes, self.need_bytes, picks):
            peak = max(peak, prefix + need[o])
            prefix += kept[o]
        return max(peak, prefix + self.tail_bytes)

    def suffix_floor_bytes(self) -> list[int]:
        """``floors[i]``: the lowest peak blocks i.. and the head can reach with nothing kept before
        block i. A prefix K before block i can still meet budget B iff K + floors[i] <= B, since
        every candidate from there on is K plus a term: floors[i] = min over options of
        max(need_i, kept_i + floors[i+1]), and floors[n] = tail."""
        floors = [self.tail_bytes]
        for kept, need in zip(reversed(self.kept_bytes), reversed(self.need_bytes)):
            after = floors[-1]
            floors.append(min(max(n, k + after) for k, n in zip(kept, need)))
        floors.reverse()
        return floors


def chain_constraints(profile: Profile, options: Sequence[str] | None = None) -> ChainConstraints:
    """``profile`` as prefix-sum constraints over ``options`` (default: those every block offers)."""
    offered = profile.options
    if options is None:
        options = offered
    not_offered = [o for o in options if o not in offered]
    if not_offered:
        raise ValueError(
            f"options {not_offered} are not offered by every block of this profile; expected a "
            f"subset of {list(offered)}{_did_you_mean(str(not_offered[0]), offered)}"
        )
    if profile.blocks and not options:
        raise ValueError(
            f"the blocks of this {profile.model} profile have no option in common (each offers "
            f"some of {list(OPTIONS)}); re-profile it so that every block offers at least 'keep'"
        )
    names = [b.name for b in profile.blocks]
    if len(set(names)) != len(names):
        duplicate = next(n for n in names if names.count(n) > 1)
        raise ValueError(
            f"block name {duplicate!r} appears twice in this profile; expected unique names"
        )
    options = tuple(o for o in OPTIONS if o in options) + tuple(
        o for o in options if o not in OPTIONS
    )
    pre, post, gather = profile.pre, profile.post, profile.gather_bytes
    lead = profile.base_bytes + pre.kept_bytes
    grads_after = profile.post.grad_bytes + sum(b.grad_bytes for b in profile.blocks)
    kept_rows, need_rows, ms_rows = [], [], []
    for block in profile.blocks:
        grads_after -= block.grad_bytes  # now: the head's grads and those of the blocks after
        costs = [block.options[o] for o in options]
        for o, c in zip(options, costs):
            if not math.isfinite(c.extra_ms):
                raise ValueError(
                    f"block {block.name!r} option {o!r} has extra_ms={c.extra_ms}; expected a "
                    "finite number of milliseconds (re-profile the model)"
                )
        kept_rows.append(tuple(c.kept_bytes for c in costs))
        need_rows.append(
            tuple(
                lead + gather + max(c.fwd_peak_bytes, grads_after + c.kept_bytes + c.bwd_peak_bytes)
                for c in costs
            )
        )
        ms_rows.append(tuple(c.extra_ms for c in costs))
    all_grads = post.grad_bytes + sum(b.grad_bytes for b in profile.blocks)
    fixed = max(
        profile.base_bytes + pre.fwd_peak_bytes,
        lead + all_grads + pre.bwd_peak_bytes,
        profile.base_bytes + all_grads + pre.grad_bytes + profile.optimizer_peak_bytes,
    )
    return ChainConstraints(
        options=options,
        kept_bytes=tuple(kept_rows),
        need_bytes=tuple(need_rows),
        extra_ms=tuple(ms_rows),
        tail_bytes=lead + max(post.fwd_peak_bytes, post.kept_bytes + post.bwd_peak_bytes),
        fixed_bytes=fixed,
    )


# --- the floor ---------------------------------------------------------------------------------


def smallest_feasible(profile: Profile) -> tuple[int, str]:
    """The lowest peak any assignment of the common options reaches, and what dominates it, e.g.
    ``(2_900_000_000, "parameters and optimizer state take 2.10 GiB")``."""
    chain = chain_constraints(profile)
    floors = chain.suffix_floor_bytes()
    peak = max(chain.fixed_bytes, floors[0])
    # One assignment that reaches it, the cheapest option at each step that keeps the rest feasible.
    picks, prefix = [], 0
    for i, (kept, need, ms) in enumerate(zip(chain.kept_bytes, chain.need_bytes, chain.extra_ms)):
        fits = [
            o
            for o in range(len(chain.options))
            if prefix + need[o] <= peak and prefix + kept[o] + floors[i + 1] <= peak
        ]
        o = min(fits, key=lambda o: (ms[o], o))
        picks.append(o)
        prefix += kept[o]
    costs = [b.options[chain.options[o]] for b, o in zip(profile.blocks, picks)]
    top = max(_phases(profile, costs), key=lambda p: p.peak_bytes)
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
