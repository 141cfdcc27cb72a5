"""The ``compiled:<budget>`` options (NOTE [ Compiled blocks ] in remat.manual.compiled): their
names, the per-module option, the solver with options that may be faster than keep, the cases
where a profile leaves them out, and (in a subprocess: NOTE [ Isolated compile tests ] in
test_compile.py) a measured profile whose mixed plans measure their prediction to the byte."""

from __future__ import annotations

import copy
import pickle
from pathlib import Path

import pytest
import torch
from _tables import brute_force, budget_near, chains
from hypothesis import given, settings
from hypothesis import strategies as st
from test_compile import check
from torch import nn

import remat
from remat import models
from remat.errors import InvalidType, InvalidValue
from remat.manual.compiled import compile_budget, compiled_option
from remat.manual.options import clear_option, option_of, set_option
from remat.plan import bounds as search
from remat.plan.chain import chain_constraints
from remat.plan.solver import InfeasibleBudget, solve
from remat.records import Plan, Profile


def test_option_names() -> None:
    assert compiled_option(0.5) == "compiled:0.5"
    assert compiled_option(1) == "compiled:1"
    assert compile_budget("compiled:0.25") == 0.25
    assert compile_budget("keep") is None
    for bad in ("compiled:0", "compiled:1.5", "compiled:half", "compiled:"):
        with pytest.raises(InvalidValue, match=r"compiled:<budget>.*\(0, 1\]"):
            compile_budget(bad)
    for budget in (0, 2, -0.5, True, "0.5"):
        with pytest.raises(InvalidValue, match=r"in \(0, 1\]"):
            compiled_option(budget)  # type: ignore[arg-type]


def _gpt() -> nn.Module:
    torch.manual_seed(0)
    return models.build_model(models.GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=16,
                                               vocab_size=64, dropout=0.0))


def test_the_option_is_set_read_and_undone_without_compiling() -> None:
    model = _gpt()
    block = model.blocks[0]
    before = pickle.dumps(model.state_dict())
    set_option(block, "compiled:0.5")
    assert option_of(block) == "compiled:0.5"
    set_option(block, "recompute")  # another option replaces it
    assert option_of(block) == "recompute"
    set_option(block, "compiled:0.2")
    copied = copy.deepcopy(model)  # data, not a closure: the copy's forward is the copy's
    assert option_of(copied.blocks[0]) == "compiled:0.2"
    assert copied.blocks[0].forward.module is copied.blocks[0]
    with torch.no_grad():  # no gradients: the eager forward, nothing compiled
        x = torch.randn(2, 16, 32)
        assert torch.equal(block(x), type(block).forward(block, x))
    clear_option(block)
    assert option_of(block) == "keep" and "forward" not in block.__dict__
    assert pickle.dumps(model.state_dict()) == before


def _with_compiled(p: Profile, extra: float) -> Profile:
    """``p`` whose blocks all offer ``compiled:0.5`` (keep's bytes halved, ``extra`` ms)."""
    import dataclasses

    blocks = []
    for b in p.blocks:
        k = b.options["keep"]
        c = dataclasses.replace(k, kept_bytes=k.kept_bytes // 2, extra_ms=extra)
        blocks.append(dataclasses.replace(b, options={**b.options, "compiled:0.5": c}))
    return dataclasses.replace(p, blocks=blocks)


def test_apply_and_plan_files_take_the_option(tmp_path: Path) -> None:
    model = _gpt()
    batch = models.make_batch(model, batch_size=2, seq_len=16)
    prof = _with_compiled(remat.profile(model, batch, repeats=1), -0.5)  # faster than keep
    assert prof.options[-1] == "compiled:0.5"
    plan = solve(prof, prof.plain_peak_bytes)  # the fastest plan
    assert set(plan.choices.values()) == {"compiled:0.5"} and plan.estimate.step_ms < prof.plain_step_ms
    path = tmp_path / "plan.json"
    plan.save(path)
    loaded = Plan.load(path)
    assert loaded.choices == plan.choices and "compiled:0.5" in loaded.choices.values()
    remat.apply(model, loaded)
    assert [option_of(b) for b in model.blocks] == list(loaded.choices.values())
    remat.remove(model)
    assert all(option_of(b) == "keep" for b in model.blocks)
    bad = Plan.from_json(loaded.to_json().replace('"compiled:0.5"', '"compiled:7"'))
    with pytest.raises(InvalidValue, match="compiled:<budget>"):
        remat.apply(model, bad)
    assert all(option_of(b) == "keep" for b in model.blocks)  # nothing applied on the error path


def test_profile_checks_the_budgets_before_running() -> None:
    model = _gpt()
    batch = models.make_batch(model, batch_size=2, seq_len=16)
    for bad, error in (("0.5", InvalidType), ((0.5, 3), InvalidValue)):
        with pytest.raises(error, match=r"\(0, 1\]"):
            remat.profile(model, batch, compile_budgets=bad)  # type: ignore[arg-type]
    cfg = models.GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=16, vocab_size=64)
    with pytest.raises(InvalidValue, match="measured profile"):
        remat.profile(lambda: models.build_model(cfg), lambda: torch.zeros(2, 16, dtype=torch.long),
                      device="h100", optimizer=lambda ps: torch.optim.AdamW(ps), compile_budgets=(0.5,))


def test_handovers_leave_them_out_with_a_warning() -> None:
    import dataclasses

    from remat.crossing import Crossing
    from remat.measure.compiled import without_compiled

    p = _with_compiled(_tables_profile(), 0.5)
    assert without_compiled(p) is p  # nothing crosses the blocks: offered
    held = dataclasses.replace(p, crossings=[Crossing(size_bytes=64, made_by=p.blocks[0].name,
                                                      dies_after=p.blocks[1].name,
                                                      saved_by={p.blocks[0].name: ["keep"]})])
    with pytest.warns(UserWarning, match=r"option compiled:0\.5 is left out.*handovers"):
        out = without_compiled(held)
    assert all("compiled:0.5" not in b.options for b in out.blocks)
    assert all("compiled:0.5" in b.options for b in held.blocks)  # the profile given is not changed


def _tables_profile() -> Profile:
    from _tables import block, cost, profile

    return profile([block(f"layers.{i}", keep=cost(10, fwd=4, bwd=6), recompute=cost(2, fwd=4, bwd=14, ms=5.0))
                    for i in range(3)])


# --- the solver with options that may be faster than keep --------------------------------------

_CHAINS = chains(max_blocks=4, max_blocks_3=6, compiled=True)


@settings(max_examples=150, deadline=None)
@given(p=_CHAINS, data=st.data())
def test_solve_with_compiled_options_equals_brute_force(p: Profile, data: st.DataObject) -> None:
    brute = brute_force(p)
    budget = budget_near(data, brute)
    best = brute.fastest_within(budget)
    try:
        plan = solve(p, budget)
    except InfeasibleBudget as info:
        assert best is None and info.smallest_bytes <= int(brute.peak_bytes.min())
        return
    assert plan.estimate.peak_bytes <= budget
    extra = plan.estimate.step_ms - p.plain_step_ms
    if plan.segments:  # segments go below or beat every per-block plan
        assert best is None or extra < best[0] + 1e-9
        return
    assert best is not None and abs(extra - best[0]) < 1e-9 and plan.estimate.peak_bytes == best[1]
    chain = chain_constraints(p)
    picks = search.optimal_picks(chain, budget, plain_limit=0)  # the bounded search, forced
    assert picks is not None
    assert (sum(row[o] for row, o in zip(chain.extra_ms, picks)), chain.peak_bytes(picks)) == best


# --- measured (a subprocess: torch.compile) -----------------------------------------------------


@pytest.mark.slow  # compiles: 25-30 s
def test_measured_compiled_options_predict_mixed_plans_to_the_byte() -> None:
    check("compiled_options")


@pytest.mark.slow  # compiles: 25-30 s
def test_compiled_options_with_side_inputs_are_offered_only_where_they_save_as_kept() -> None:
    check("compiled_side_inputs")
