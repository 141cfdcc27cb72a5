"""torch.compile cases, each run in a subprocess of its own by tests/test_compile.py.

    python tests/_compile_cases.py CASE [--control] [--threads N]

A case exits 0 when its checks pass and 1 with a traceback when one fails. ``--control`` runs the
same model compiled the same way with no remat at all: when a case dies inside torch (a signal, not
an exception), the control tells a crash of torch's code generation apart from one of remat's
(NOTE [ Isolated compile tests ] in test_compile.py). Imports are inside the cases, so that the
harness's own test can run a case without importing torch.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import os
import sys
from collections.abc import Callable
from typing import Any


def _grads_close(model: Any, ref: Any, batch: Any, loss_fn: Any) -> None:
    import torch

    from remat.measure.step import forward_loss

    for m in (model, ref):
        m.zero_grad(set_to_none=True)
    loss = forward_loss(model, batch, loss_fn)
    loss.backward()
    ref_loss = forward_loss(ref, batch, loss_fn)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def _plain_compiled_step(model: Any, batch: Any, loss_fn: Any, **compile_kw: Any) -> None:
    """The control: the same model, compiled the same way, one step, no remat anywhere."""
    import torch

    from remat.measure.step import forward_loss

    forward_loss(torch.compile(model, **compile_kw), batch, loss_fn).backward()


def fullgraph_gpt(control: bool) -> None:
    """A pure-torch GPT whose blocks remat wraps (an instance-level forward): one graph, no
    break; gradients equal eager plain's to round-off; the saving survives compilation."""
    import torch

    import remat
    from remat import models
    from remat.measure.step_memory import measure_step

    torch.manual_seed(0)
    cfg = models.GPTConfig(n_layer=2, n_embd=64, n_head=2, block_size=128, vocab_size=256, dropout=0.0)
    model = models.build_model(cfg)
    batch = models.make_batch(model, batch_size=4, seq_len=128)
    loss_fn = models.loss_fn_for(model)
    if control:
        return _plain_compiled_step(model, batch, loss_fn, fullgraph=True)
    ref = copy.deepcopy(model)
    plain = measure_step(ref, batch, loss_fn=loss_fn, repeats=0)
    plan = remat.solve(remat.profile(model, batch, loss_fn=loss_fn, repeats=1), method="all", budget=None)
    plan = dataclasses.replace(plan, choices={"blocks.0": "selective", "blocks.1": "recompute"})
    remat.apply(model, plan)
    compiled = torch.compile(model, fullgraph=True)  # a graph break is an error
    _grads_close(compiled, ref, batch, loss_fn)
    planned = measure_step(compiled, batch, loss_fn=loss_fn, repeats=0)
    assert planned.kept_bytes < plain.kept_bytes, (planned.kept_bytes, plain.kept_bytes)
    assert planned.peak_bytes < plain.peak_bytes, (planned.peak_bytes, plain.peak_bytes)


def transformers_gpt2(control: bool) -> None:
    """GPT-2 from transformers (remat sets the layers' own checkpointing hook) under a 75% budget:
    compiled with the plan, it stays within the budget and below the compiled plain step."""
    import torch
    import torch.nn.functional as F

    import remat
    from remat.measure.step_memory import measure_step
    from remat.models import hf

    model, batch, _ = hf.build("gpt2", n_layer=2, use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    batch = {"input_ids": batch["input_ids"]}

    def loss_fn(output: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        # The loss outside the model: transformers' own loss path logs a warning, a graph break.
        logits = output.logits[:, :-1]
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch["input_ids"][:, 1:].reshape(-1))

    if control:
        return _plain_compiled_step(model, batch, loss_fn)
    ref = copy.deepcopy(model)
    plain = measure_step(torch.compile(copy.deepcopy(model)), batch, loss_fn=loss_fn, repeats=0)
    plan = remat.auto(model, batch, "75%", loss_fn=loss_fn, repeats=1)
    assert any(o != "keep" for o in plan.choices.values()), plan.choices
    compiled = torch.compile(model)
    _grads_close(compiled, ref, batch, loss_fn)
    planned = measure_step(compiled, batch, loss_fn=loss_fn, repeats=0)
    assert plan.budget_bytes is not None
    assert planned.peak_bytes <= plan.budget_bytes, (planned.peak_bytes, plan.budget_bytes)
    assert planned.peak_bytes < plain.peak_bytes, (planned.peak_bytes, plain.peak_bytes)


def batchnorm_convnet(control: bool) -> None:
    """A residual CNN with BatchNorm, every block recomputed: compile functionalizes the running
    statistics, so the recompute in the compiled backward does not update them a second time."""
    import torch

    import remat
    from remat import models

    torch.manual_seed(0)
    cfg = models.ConvNetConfig(image_size=16, channels=(4, 8), blocks_per_stage=1, num_classes=5, dropout=0.0)
    model = models.build_model(cfg)
    batch = models.make_batch(model, batch_size=4, image_size=16)
    loss_fn = models.loss_fn_for(model)
    if control:
        return _plain_compiled_step(model, batch, loss_fn, fullgraph=True)
    ref = copy.deepcopy(model)
    plan = remat.solve(remat.profile(model, batch, loss_fn=loss_fn, repeats=1), method="all", budget=None)
    remat.apply(model, plan)
    _grads_close(torch.compile(model, fullgraph=True), ref, batch, loss_fn)
    buffers = dict(ref.named_buffers())
    assert any(name.endswith("num_batches_tracked") for name in buffers)
    for name, buf in model.named_buffers():
        torch.testing.assert_close(buf, buffers[name], rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def compiled_options(control: bool) -> None:
    """Blocks compiled at two activation budgets as per-block options (NOTE [ Compiled blocks ]):
    a profile measures them, and plans that mix them with eager options and segments measure
    their prediction to the byte; gradients equal eager plain's to round-off; apply and remove
    leave the model as it was."""
    import torch

    import remat
    from remat import models
    from remat.manual.options import option_of
    from remat.measure.step_memory import measure_step
    from remat.plan.segment_estimate import estimate_segments
    from remat.plan.solver import smallest_any

    torch.manual_seed(0)
    cfg = models.GPTConfig(n_layer=3, n_embd=64, n_head=2, block_size=64, vocab_size=256, dropout=0.0)
    model = models.build_model(cfg)
    batch = models.make_batch(model, batch_size=4, seq_len=64)
    opt = torch.optim.AdamW(model.parameters())
    if control:
        _plain_compiled_step(model.blocks[0], torch.randn(4, 64, 64), lambda out, _: out.sum())
        return
    ref = copy.deepcopy(model)
    prof = remat.profile(model, batch, optimizer=opt, repeats=1, compile_budgets=(0.5, 0.2))
    assert prof.options[-2:] == ("compiled:0.5", "compiled:0.2"), prof.options
    keep, half, fifth = (prof.blocks[0].options[o].kept_bytes for o in ("keep", "compiled:0.5", "compiled:0.2"))
    assert keep > half > fifth, (keep, half, fifth)  # a lower budget keeps less
    names = [b.name for b in prof.blocks]
    mixes = [("compiled:0.5",) * 3, ("compiled:0.2",) * 3, ("compiled:0.5", "keep", "recompute"),
             ("keep", "compiled:0.2", "compiled:0.5"), ("selective", "compiled:0.5", "compiled:0.2")]
    cases = [(dict(zip(names, m)), []) for m in mixes]
    cases.append((dict(zip(names, ("keep", "keep", "compiled:0.2"))), [[names[0], names[1]]]))  # a segment
    base = remat.solve(prof, prof.plain_peak_bytes)
    for choices, segments in cases:
        predicted = estimate_segments(prof, choices, segments).peak_bytes
        remat.apply(model, dataclasses.replace(base, choices=choices, segments=segments))
        assert [option_of(b) for b in model.blocks] == list(choices.values())
        measured = measure_step(model, batch, optimizer=opt).peak_bytes
        remat.remove(model)
        assert measured == predicted, (choices, segments, measured, predicted)
    low, high = smallest_any(prof)[0], prof.plain_peak_bytes
    for k in range(5):  # the solver's plans, from the plain peak down to the lowest
        plan = remat.solve(prof, high - (high - low) * k // 4)
        remat.apply(model, plan)
        measured = measure_step(model, batch, optimizer=opt).peak_bytes
        remat.remove(model)
        assert measured == plan.estimate.peak_bytes, (plan.choices, plan.segments, measured, plan.estimate)
    remat.apply(model, dataclasses.replace(base, choices=dict(zip(names, ("compiled:0.2",) * 3)), segments=[]))
    _grads_close(model, ref, batch, None)
    remat.remove(model)
    assert all("forward" not in b.__dict__ for b in model.blocks)
    _grads_close(model, ref, batch, None)
    # a plan with compiled options (compiled functions are reused: nothing compiles again), verified
    target = remat.estimate(prof, dict(zip(names, ("compiled:0.2",) * 3))).peak_bytes
    plan = remat.solve(prof, target)
    assert any(o.startswith("compiled:") for o in plan.choices.values()), plan.choices
    remat.apply(model, plan)
    report = remat.verify(model, batch, plan, optimizer=opt, repeats=1)
    assert report.fits and report.grads_equal and report.plain_ran, report
    assert report.measured_peak_bytes == report.predicted_peak_bytes, report
    remat.remove(model)
    # auto at that budget runs no step above it, and a step with every block compiled is not known
    # to fit before it runs: compiled options are left out (NOTE [ Planning what does not fit ])
    try:
        remat.auto(model, batch, target, optimizer=opt, compile_budgets=(0.5, 0.2), repeats=1)
    except remat.InfeasibleBudget:
        pass
    else:
        raise AssertionError("compiled options were measured where the plain step does not fit")


def _exact_plans(prof: Any, model: Any, batch: Any, loss_fn: Any, opt: Any, count: int) -> None:
    """Random plans of every option but tiled, and every block on each compiled option: each
    measures its predicted peak to the byte."""
    import random

    import remat
    from remat.measure.step_memory import measure_step
    from remat.plan.segment_estimate import estimate_segments

    names = [b.name for b in prof.blocks]
    options = [o for o in prof.options if o != "tiled"]
    rng = random.Random(0)
    mixes = [tuple(rng.choice(options) for _ in names) for _ in range(count)]
    mixes += [(o,) * len(names) for o in options if o.startswith("compiled:")]
    base = remat.solve(prof, prof.plain_peak_bytes)
    for mix in mixes:
        choices = dict(zip(names, mix))
        remat.apply(model, dataclasses.replace(base, choices=choices, segments=[]))
        measured = measure_step(model, batch, loss_fn=loss_fn, optimizer=opt).peak_bytes
        remat.remove(model)
        predicted = estimate_segments(prof, choices, []).peak_bytes
        assert measured == predicted, (mix, measured, predicted)


def compiled_side_inputs(control: bool) -> None:
    """Compiled options where side inputs cross the blocks: transformers' Llama passes its rotary
    tables to every layer, and a compiled layer saves them as the kept one does, so the options
    are offered and mixed plans measure their prediction; a pure-torch loop whose blocks add a
    side input before a sine, which the eager block does not save and a compiled one may (its
    partitioner can keep the graph's inputs and recompute the sum): there the option is left out
    with a warning that says so, or, where the partitioner saves as eager does, offered and exact."""
    import warnings

    import torch

    import remat

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                   max_position_embeddings=64, use_cache=False, attn_implementation="sdpa")
    model = transformers.LlamaForCausalLM(cfg).train()
    ids = torch.randint(256, (4, 64))
    batch = {"input_ids": ids, "labels": ids}
    if control:
        _plain_compiled_step(model, batch, None)
        return
    opt = torch.optim.AdamW(model.parameters())
    prof = remat.profile(model, batch, optimizer=opt, repeats=1, compile_budgets=(0.5, 0.2))
    assert any(c.enters_blocks for c in prof.crossings) and prof.options[-2:] == ("compiled:0.5", "compiled:0.2"), prof.options
    _exact_plans(prof, model, batch, None, opt, 6)

    from test_loops import LinearFirst, Loop, _loss  # the same loop, in this case's own process

    loop = Loop(LinearFirst)
    x = torch.randn(8, 64, 64)
    loss = _loss
    opt = torch.optim.AdamW(loop.parameters())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        prof = remat.profile(loop, x, loss_fn=loss, optimizer=opt, repeats=1, compile_budgets=(0.2,))
    assert any(c.enters_blocks for c in prof.crossings)
    left_out = [str(w.message) for w in caught if "is left out of this profile" in str(w.message)]
    assert bool(left_out) == ("compiled:0.2" not in prof.options), (left_out, prof.options)
    assert all("compiled:0.2" in m and "saved by" in m for m in left_out), left_out
    _exact_plans(prof, loop, x, loss, opt, 6)
    print("sine loop:", "left out" if left_out else "offered", left_out[:1])


def aborts(control: bool) -> None:
    """The harness's own check: a process that dies as Inductor's code did (SIGABRT)."""
    sys.stderr.write("free(): invalid next size (normal)\n")
    sys.stderr.flush()
    os.abort()


def aborts_with_remat_only(control: bool) -> None:
    """The harness's own check: dies only with remat, so the crash is remat's to answer for."""
    if not control:
        os.abort()


CASES: dict[str, Callable[[bool], None]] = {
    f.__name__: f
    for f in (fullgraph_gpt, transformers_gpt2, batchnorm_convnet, compiled_options, compiled_side_inputs, aborts,
              aborts_with_remat_only)
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("case", choices=sorted(CASES))
    parser.add_argument("--control", action="store_true", help="the same model without remat")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    args = parser.parse_args()
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    CASES[args.case](args.control)


if __name__ == "__main__":
    main()
