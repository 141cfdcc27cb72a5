"""What a refusal says: a budget below the smallest feasible, with what dominates it and what to do.
"""

from __future__ import annotations

from remat.errors import InfeasibleBudget, first_names
from remat.records import Profile
from remat.units import format_bytes

__all__ = ["exact_bytes", "in_eval_mode", "infeasible", "ran_out_verifying", "ran_out_within", "tied_note"]


def infeasible(profile: Profile, budget_bytes: int, smallest: int, dominant: str,
               estimated: bool = False) -> InfeasibleBudget:
    """The refusal of ``budget_bytes`` for ``profile``, whose smallest feasible peak is ``smallest``
    (``dominant``: what dominates it, or where it falls); ``estimated``: a profile whose bytes are
    the step's tensors alone, no real step having fit the budget (``InfeasibleBudget.estimated``)."""
    assert smallest > budget_bytes, (smallest, budget_bytes)
    if 2 * (profile.param_bytes + profile.optimizer_bytes) >= smallest:
        advice = (
            "raise the budget, or shard the parameters and optimizer state over more devices (FSDP)"
        )
    else:
        advice = "raise the budget or lower the batch"
    if profile.repeated:
        advice += (f", or checkpoint every call of {first_names(profile.repeated)}, which ran more than once in the "
                   "step and kept its activations: remat.auto, and remat.profile given this budget, do so where "
                   "no plan fits without; or run remat.checkpoint_module(model.get_submodule(name)) on each "
                   "before profiling (in the model factory, for a profile on fake tensors)")
    source, caveat = ("from the step tensors alone, ", (
        ": what no tensor holds (a kernel's scratch space, as a convolution's or a loss's temporary) is "
        "measured only by a real step, none of which fits this budget, and may put it higher")) if estimated else ("", "")
    if not estimated and not profile.plain_ran:  # a lean profile's, made once a real step ran within the budget
        caveat = (", what no tensor holds included (a kernel's scratch space, as a convolution's or a loss's "
                  "temporary), measured by a real step within this budget")
    return InfeasibleBudget(
        f"budget {exact_bytes(budget_bytes, smallest)} is below the smallest feasible {source}"
        f"{exact_bytes(smallest, budget_bytes)} ({dominant}){caveat}; {advice}.",
        budget_bytes=budget_bytes,
        smallest_bytes=smallest,
        dominant=dominant,
        estimated=estimated,
        repeated=profile.repeated,
        plain_bytes=profile.plain_peak_bytes,
    )


def tied_note(profile: Profile) -> list[str]:
    """A plan's note on the modules its profile checkpointed on every call (``Profile.tied``)."""
    if not profile.tied:
        return []
    timed = (f"its recompute ({profile.tied_ms:.1f} ms, its calls' time in a forward) is in the overhead"
             if profile.tied_ms else "the overhead leaves out its recompute, which steps on fake tensors do not time")
    return [f"{first_names(profile.tied)} ran more than once per step and no plan fit the budget with its "
            f"activations kept: every call of it is checkpointed (Plan.tied); {timed} (NOTE [ Every call of a "
            "tied module ] in remat.measure.tied)"]


def in_eval_mode(error: InfeasibleBudget) -> InfeasibleBudget:
    """``error`` for a model that was profiled in ``eval()`` mode: say so, since the likely fix
    is ``model.train()``, not a larger budget."""
    head = str(error).rsplit("; ", 1)[0]
    return InfeasibleBudget(
        f"{head}; the model is in eval() mode, but remat plans training steps: call model.train() "
        "before planning (if it still does not fit, raise the budget or lower the batch).",
        budget_bytes=error.budget_bytes, smallest_bytes=error.smallest_bytes,
        dominant=error.dominant, estimated=error.estimated, repeated=error.repeated, plain_bytes=error.plain_bytes,
    )


def ran_out_within(budget_bytes: int, why: str, host: bool = False) -> InfeasibleBudget:
    """The refusal of ``budget_bytes`` where a real step predicted within it from its tensors ran
    out of memory (``why``): the first is the floor plan's, so no plan fits; the smallest is above
    the budget (``InfeasibleBudget.estimated``). ``host``: the step ran on the CPU, whose memory
    remat's own profiling shares."""
    return InfeasibleBudget(
        f"budget {format_bytes(budget_bytes)} is below the smallest feasible on this device: the floor plan's "
        f"step, predicted within it from its tensors, ran out of memory ({why}). {_ran_out_why(host)} Raise the "
        "budget or lower the batch.",
        budget_bytes=budget_bytes, smallest_bytes=budget_bytes + 1, dominant="what no tensor holds", estimated=True,
    )


def ran_out_verifying(budget_bytes: int, predicted_bytes: int, why: str, host: bool = False) -> InfeasibleBudget:
    """The refusal of ``budget_bytes`` where the plan solved for it, predicted at
    ``predicted_bytes``, ran out of memory (``why``) when ``remat.auto`` verified it."""
    return InfeasibleBudget(
        f"no plan was verified within the budget {exact_bytes(budget_bytes, predicted_bytes)}: the plan solved "
        f"for it, predicted at {exact_bytes(predicted_bytes, budget_bytes)}, ran out of memory when its step ran "
        f"({why}). {_ran_out_why(host)} Raise the budget or lower the batch. The model was left without a plan.",
        budget_bytes=budget_bytes, smallest_bytes=budget_bytes + 1, dominant="what no tensor holds", estimated=True,
    )


def _ran_out_why(host: bool) -> str:
    """Why a step predicted within the budget ran out; ``host``: it ran on the CPU."""
    shared = (" On the CPU, remat's profiling shares that memory (its profiler's records, a fake copy of the "
              "model: tens of MB)." if host else "")
    return ("What no tensor holds (a kernel's scratch space, as a convolution's or a loss's temporary) takes the "
            "rest, or the device holds less than "
            f"the budget besides what is already on it.{shared}")


def exact_bytes(n: int, other: int) -> str:
    """``n`` for people, with the exact count when it would read the same as ``other``."""
    text = format_bytes(n)
    return f"{text} ({n} bytes)" if text == format_bytes(other) else text
