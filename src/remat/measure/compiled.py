"""The ``compiled:<budget>`` options of every block, measured (NOTE [ Compiled blocks ] in
``remat.manual.compiled``).

Per budget: one untimed step with every block compiled at that budget (it compiles; compile-time
memory and time stay out of the numbers), then one traced step, read along the step's schedule as
every option's is (``attribute``), against the profile's own kept step. Then steps timed in
turns, every block kept and every block compiled at each budget, give each block's extra time:
its compiled forward and backward minus its kept ones. Blocks of one kind and size share the
median. The extra time may be negative (generated code can be faster than the eager block's),
and is kept as measured.

Crossings (NOTE [ Tensors that cross a block boundary ] in ``remat.crossing``): the cost model reads
what a block saves of a side input from the kept step, so a compiled option is offered only when a
step with every block on it saves and frees each side input where the kept step does (a
saved-tensors hook notes what each compiled graph saves; Llama's rotary tables pass); its numbers
are then read as the kept run's (``remat.plan.sides.saves_as_kept``). Otherwise, and on a profile
with handovers (what a compiled block saves of them is not measured), the option is left out with
a warning that says why, rather than offered with numbers that could under-predict.
"""

from __future__ import annotations

import dataclasses
import statistics
import warnings
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from torch import nn

from remat.crossing import Crossing
from remat.errors import InvalidType, InvalidValue
from remat.manual.compiled import PREFIX, compiled_option
from remat.measure.attribution import attribute_over_keep
from remat.measure.notes import StepNotes
from remat.measure.runner import StepRunner, every_block
from remat.measure.sides import read_side_inputs
from remat.measure.tracer import Trace
from remat.plan.handovers import handovers
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
                     sides: list[Crossing], kept: tuple[Trace, StepNotes]) -> dict[str, dict[str, OptionCost]]:
    """Block name -> option -> its cost, for each compiled option (the module's docstring).
    ``sides``: the profile's side inputs, as the kept step saves and frees them; ``kept``: the
    profile's traced step with every block kept, and its hooks."""
    if not options:
        return {}
    if runner.estimated:
        raise InvalidValue("compile_budgets needs a measured profile (a real model on a real device): "
                           "a compiled graph's memory and speed cannot be estimated from fake tensors")
    numbers = {}
    for option in options:
        with every_block(named, option):
            runner.marked(lambda _: None)  # compiles
            run, run_hooks, _ = runner.traced()
            saved: dict[Any, set[int]] = {}
            saving = runner.marked(lambda _: None, saved=saved) if sides else run_hooks
        if sides and (mine := read_side_inputs(run_hooks, saving, saved, [n for n, _ in named])) != sides:
            _warn(option, _difference(sides, mine))
            continue
        numbers[option] = attribute_over_keep((run, run_hooks), kept, list(named), sides)
    options = list(numbers)
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
            out[name][option] = n.cost(statistics.median(groups[kind]))
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
    if not (handed := handovers(profile)):
        return profile
    for option in sorted({o for b in profile.blocks for o in b.options if o.startswith(PREFIX)}, reverse=True):
        _warn(option, f"{len(handed)} tensor(s) the blocks return are held past the next block "
                      "(handovers), and what a compiled block saves of them is not measured")
    blocks = [dataclasses.replace(b, options={k: v for k, v in b.options.items() if not k.startswith(PREFIX)})
              for b in profile.blocks]
    return dataclasses.replace(profile, blocks=blocks)


def _difference(kept: list[Crossing], compiled: list[Crossing]) -> str:
    if len(kept) != len(compiled):
        return f"{len(compiled)} side inputs where the kept step has {len(kept)}"
    k, c = next((k, c) for k, c in zip(kept, compiled) if k != c)
    return (f"a side input of {k.size_bytes} B into {k.consumers[0]}.. is saved by {list(c.savers)} and freed in "
            f"{c.dies_after or 'the head'}, where the kept step has {list(k.savers)} and {k.dies_after or 'the head'}")


def _warn(option: str, why: str) -> None:
    warnings.warn(
        f"option {option} is left out of this profile: {why}. The cost model reads the side inputs "
        "and handovers as the kept step saves them, so a compiled block must save the same ones "
        "(NOTE [ Compiled blocks ]); the other options are planned as usual", stacklevel=4,
    )
