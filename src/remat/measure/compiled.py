"""The ``compiled:<budget>`` options of every block, measured (NOTE [ Compiled blocks ] in
``remat.manual.compiled``).

Per budget: one untimed step with every block compiled at that budget (it compiles; compile-time
memory and time stay out of the numbers), then one traced step, read along the step's schedule as
every option's is (``attribute``). Then steps timed in turns, every block kept and every block
compiled at each budget, give each block's extra time: its compiled forward and backward minus its
kept ones. Blocks of one kind and size share the median. The extra time may be negative (generated
code can be faster than the eager block's), and is kept as measured.

Only where nothing crosses blocks but the hidden state: with side inputs or handovers the cost
model reads what each option saves of them from the eager runs (NOTE [ Side inputs ] and NOTE
[ Handovers ] in ``remat.records``), which a compiled graph's partitioner may not match, so there
the options are left out with a warning rather than offered with numbers that could under-predict.
"""

from __future__ import annotations

import dataclasses
import statistics
import warnings
from collections import defaultdict
from collections.abc import Sequence

from torch import nn

from remat.errors import InvalidType, InvalidValue
from remat.manual.compiled import PREFIX, compiled_option
from remat.measure.attribution import attribute_over_keep
from remat.measure.runner import StepRunner, every_block
from remat.records import OptionCost, Profile

__all__ = ["add_options", "check_budgets", "measure_compiled", "without_compiled"]


def check_budgets(budgets: Sequence[float] | None) -> tuple[str, ...]:
    """The option names of ``profile(compile_budgets=...)``, checked: one per distinct budget."""
    if budgets is None:
        return ()
    if isinstance(budgets, str | bytes) or not isinstance(budgets, Sequence):
        raise InvalidType(f"compile_budgets is a sequence of numbers in (0, 1], e.g. (0.5, 0.2); got {budgets!r}")
    return tuple(dict.fromkeys(compiled_option(b) for b in budgets))


def measure_compiled(named: Sequence[tuple[str, nn.Module]], runner: StepRunner, options: Sequence[str],
                     *, side_inputs: int = 0) -> dict[str, dict[str, OptionCost]]:
    """Block name -> option -> its cost, for each compiled option (the module's docstring);
    nothing, with a warning, when ``side_inputs`` (their number) cross the blocks."""
    if not options:
        return {}
    if side_inputs:
        _warn(f"{side_inputs} side input(s)")
        return {}
    if runner.estimated:
        raise InvalidValue("compile_budgets needs a measured profile (a real model on a real device): "
                           "a compiled graph's memory and speed cannot be estimated from fake tensors")
    with every_block(named, "keep"):
        trace, hooks, _ = runner.traced()
    numbers = {}
    for option in options:
        with every_block(named, option):
            runner.marked(lambda _: None)  # compiles
            run, run_hooks, _ = runner.traced()
        numbers[option] = attribute_over_keep((run, run_hooks), (trace, hooks), list(named))
    configs = [lambda o=o: every_block(named, o) for o in ("keep", *options)]
    keep, *timed = runner.times(configs)
    out: dict[str, dict[str, OptionCost]] = {name: {} for name, _ in named}
    for option, times in zip(options, timed):
        groups: dict[tuple[str, int], list[float]] = defaultdict(list)
        kinds = [(type(m).__name__, sum(p.numel() for p in m.parameters())) for _, m in named]
        for i, kind in enumerate(kinds):
            groups[kind].append(times[f"fwd{i}"] + times[f"bwd{i}"] - keep[f"fwd{i}"] - keep[f"bwd{i}"])
        for i, ((name, _), kind) in enumerate(zip(named, kinds)):
            n = numbers[option][i]
            out[name][option] = OptionCost(kept_bytes=n["kept"], fwd_peak_bytes=n["fwd_peak"],
                                           bwd_peak_bytes=n["bwd_peak"], extra_ms=statistics.median(groups[kind]))
    return out


def add_options(profile: Profile, costs: dict[str, dict[str, OptionCost]]) -> Profile:
    """``profile`` with each block's options from ``costs`` added (block name -> option -> cost)."""
    if not any(costs.values()):
        return profile
    blocks = [dataclasses.replace(b, options={**b.options, **costs.get(b.name, {})}) for b in profile.blocks]
    return dataclasses.replace(profile, blocks=blocks)


def without_compiled(profile: Profile) -> Profile:
    """``profile`` without compiled options where its side inputs or handovers rule them out (the
    module's docstring), with a warning that says why; else ``profile`` itself."""
    if not any(o.startswith(PREFIX) for b in profile.blocks for o in b.options):
        return profile
    what = [f"{len(profile.side_inputs)} side input(s)"] if profile.side_inputs else []
    what += [f"{len(profile.handovers)} handover(s)"] if profile.handovers else []
    if not what:
        return profile
    _warn(" and ".join(what))
    blocks = [dataclasses.replace(b, options={k: v for k, v in b.options.items() if not k.startswith(PREFIX)})
              for b in profile.blocks]
    return dataclasses.replace(profile, blocks=blocks)


def _warn(what: str) -> None:
    warnings.warn(
        f"the compiled options are left out of this profile: tensors other than the hidden state "
        f"cross its blocks ({what}), and what a compiled graph saves of them is not measured; the "
        "eager options are planned as usual", stacklevel=4,
    )
