"""The one cost model: a step's peak bytes and time for one assignment of options to blocks.

``estimate`` replays one training step phase by phase and tracks the bytes live on the device;
every solver and ``verify`` use it, so "fits the budget" means one thing everywhere.
``remat.plan.chain`` rewrites the same arithmetic as prefix-sum constraints, the form the solvers
search; ``smallest_feasible`` is the lowest peak any assignment reaches. Pure numbers: no torch,
no numpy, no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from remat.errors import InvalidType, InvalidValue, did_you_mean
from remat.plan.chain import ChainConstraints, chain_constraints
from remat.plan.handovers import handed_over, handovers
from remat.plan.schedule import phase_bytes, step_phases
from remat.plan.sides import side_groups
from remat.records import Estimate, OptionCost, Profile
from remat.units import format_bytes
from remat.vocabulary import OPTIONS

__all__ = ["estimate", "overhead", "priced_picks", "smallest_feasible"]


def estimate(profile: Profile, choices: Mapping[str, str]) -> Estimate:
    """Predict the peak bytes and step time of ``profile``'s step with ``choices`` applied.

    ``choices`` maps every block name to one of the options that block offers.
    """
    costs = _chosen_costs(profile, choices)
    options = [choices[b.name] for b in profile.blocks]
    if handovers(profile):  # NOTE [ Tensors that cross a block boundary ] in remat.crossing
        costs = _chosen_costs(profile := handed_over(profile, options), choices)
    phases = _phases(profile, costs, options)
    peak = max(phases, key=lambda p: p.peak_bytes)  # max() keeps the first phase reaching it
    step_ms = profile.plain_step_ms + sum(c.extra_ms for c in costs)
    return Estimate(
        peak_bytes=peak.peak_bytes, peak_phase=peak.name, step_ms=step_ms, overhead=overhead(profile, step_ms)
    )


def overhead(profile: Profile, step_ms: float) -> float:
    """``step_ms`` over the plain step's, minus one: every block kept, and the modules that ran
    more than once too (``Profile.tied_ms``: recomputed in the profile's plain step)."""
    plain = profile.plain_step_ms - profile.tied_ms
    return step_ms / plain - 1.0 if plain > 0 else 0.0


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
        kept, transient, grad = phase_bytes(profile, costs, phase)
        extra = 0
        if phase.part == "block":
            assert phase.block is not None
            added = sides.delta_bytes if phase.stage == "backward" else sides.fwd_delta_bytes
            extra = added(held[phase.block], phase.block)
        elif phase.stage == "backward" and phase.part == "post":
            extra = sides.post_bwd_extra_bytes(last)
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


# --- the floor ---------------------------------------------------------------------------------


def smallest_feasible(profile: Profile) -> tuple[int, str]:
    """The lowest peak any assignment of the common options reaches, and what dominates it, e.g.
    ``(2_900_000_000, "parameters and optimizer state take 2.10 GiB")``."""
    chain = chain_constraints(profile)
    peak, picks = _floor(chain)
    # the bound's floor is no plan's: the lowest of the plans priced exactly
    tops = [_top(profile, chain.chosen(p)) for p in (priced_picks(chain, picks) if chain.bound else [picks])]
    assert tops[0].peak_bytes == peak or (chain.bound and tops[0].peak_bytes < peak), (tops[0].peak_bytes, peak)
    top = min(tops, key=lambda p: p.peak_bytes)
    return top.peak_bytes, _dominant(profile, top)


def _floor(chain: ChainConstraints) -> tuple[int, list[int]]:
    """The chain's lowest peak, and one assignment that reaches it: the cheapest option at each
    step that keeps the rest feasible."""
    floors = chain.suffix_floors()  # [i][side-input state]
    peak = max(chain.fixed_bytes, floors[0][0])
    picks, prefix, held = [], 0, 0
    for i, ms in enumerate(chain.extra_ms):
        now = [chain.entering(i, o, held) for o in range(len(ms))]
        fits = [
            o
            for o in range(len(chain.options))
            if prefix + chain.need_at(i, o, now[o]) <= peak
            and prefix + chain.kept_at(i, o, now[o]) + floors[i + 1][chain.leaving(i, now[o])] <= peak
        ]
        o = min(fits, key=lambda o: (ms[o], o))
        picks.append(o)
        prefix, held = prefix + chain.kept_at(i, o, now[o]), chain.leaving(i, now[o])
    return peak, picks


def priced_picks(chain: ChainConstraints, floor: list[int] | None = None) -> list[list[int]]:
    """Where handovers are pinned (rule 5 of NOTE [ What crosses a block boundary, as state ] in
    remat.plan.crossings), the searches read plans above their cost; ``estimate`` prices these
    exactly: the chain's floor plan, and one option on every block, for each of keep, selective
    and recompute it offers. BS-RoFormer's 16 band outputs, 6 pinned, put the floor 31,048 B above
    every block recomputed (torch's checkpoint on every block, to the byte). ``floor``: the floor
    plan's picks, where the caller has them."""
    n = len(chain.extra_ms)
    return [floor if floor is not None else _floor(chain)[1], *([chain.options.index(o)] * n for o in ("keep", "selective", "recompute")
                                if o in chain.options)]


def _top(profile: Profile, names: Sequence[str]) -> _Phase:
    """The phase of the highest peak of the step with ``names``, one option per block."""
    handed = handed_over(profile, names)  # NOTE [ Tensors that cross a block boundary ] in remat.crossing
    costs = [b.options[name] for b, name in zip(handed.blocks, names)]
    return max(_phases(handed, costs, names), key=lambda p: p.peak_bytes)


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
