"""torch.compile over a model with a plan applied (CPU, inductor): it compiles, remat adds no graph
break, gradients equal plain eager PyTorch's to round-off (compile reorders float ops), and the
plan's memory saving survives compilation (measured with measure_step on the compiled module).

Dropout is off here: compiled code draws its own random numbers (inductor's RNG), so a compiled
step never matches an eager one bit for bit with dropout on, plan or no plan.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import remat
from remat import models
from remat.measure.step import forward_loss
from remat.measure.tracer import measure_step

pytestmark = [
    pytest.mark.slow,  # each test compiles a forward and a backward graph, or two (20-40 s)
    # Importing inductor imports torch.utils.mkldnn, whose ScriptModules use the deprecated
    # torch.jit.script_method: torch's own import-time warning, nothing a user can change.
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"),
]


@pytest.fixture(autouse=True)
def fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def assert_grads_close(model: nn.Module, ref: nn.Module, batch: Any, loss_fn: Any) -> None:
    for m in (model, ref):
        m.zero_grad(set_to_none=True)
    loss = forward_loss(model, batch, loss_fn)
    loss.backward()
    ref_loss = forward_loss(ref, batch, loss_fn)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def test_fullgraph_with_recompute_and_selective() -> None:
    """A pure-torch GPT whose blocks remat wraps (an instance-level forward): one graph, no break."""
    torch.manual_seed(0)
    cfg = models.GPTConfig(n_layer=2, n_embd=64, n_head=2, block_size=128, vocab_size=256, dropout=0.0)
    model = models.build_model(cfg)
    batch = models.make_batch(model, batch_size=4, seq_len=128)
    loss_fn = models.loss_fn_for(model)
    ref = copy.deepcopy(model)
    plain = measure_step(ref, batch, loss_fn=loss_fn, repeats=0)
    plan = remat.solve(remat.profile(model, batch, loss_fn=loss_fn, repeats=1), method="all", budget=None)
    plan = dataclasses.replace(plan, choices={"blocks.0": "selective", "blocks.1": "recompute"})
    remat.apply(model, plan)
    compiled = torch.compile(model, fullgraph=True)  # a graph break is an error
    assert_grads_close(compiled, ref, batch, loss_fn)
    planned = measure_step(compiled, batch, loss_fn=loss_fn, repeats=0)
    assert planned.kept_bytes < plain.kept_bytes
    assert planned.peak_bytes < plain.peak_bytes, (planned.peak_bytes, plain.peak_bytes)


def test_compiled_transformers_model_keeps_the_saving() -> None:
    """GPT-2 from transformers (remat sets the layers' own checkpointing hook) under a 75% budget:
    compiled with the plan, it stays within the budget and below the compiled plain step."""
    pytest.importorskip("transformers")
    from remat.models import hf

    model, batch, _ = hf.build("gpt2", n_layer=2, use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    batch = {"input_ids": batch["input_ids"]}

    def loss_fn(output: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        # The loss outside the model: transformers' own loss path logs a warning, a graph break.
        logits = output.logits[:, :-1]
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch["input_ids"][:, 1:].reshape(-1))

    ref = copy.deepcopy(model)
    compiled_plain = torch.compile(copy.deepcopy(model))
    plain = measure_step(compiled_plain, batch, loss_fn=loss_fn, repeats=0)
    plan = remat.auto(model, batch, "75%", loss_fn=loss_fn, repeats=1)
    assert any(o != "keep" for o in plan.choices.values())
    compiled = torch.compile(model)
    assert_grads_close(compiled, ref, batch, loss_fn)
    planned = measure_step(compiled, batch, loss_fn=loss_fn, repeats=0)
    assert plan.budget_bytes is not None
    assert planned.peak_bytes <= plan.budget_bytes, (planned.peak_bytes, plan.budget_bytes)
    assert planned.peak_bytes < plain.peak_bytes, (planned.peak_bytes, plain.peak_bytes)


def test_batchnorm_statistics_move_once_when_compiled() -> None:
    """A residual CNN with BatchNorm, every block recomputed: compile functionalizes the running
    statistics, so the recompute in the compiled backward does not update them a second time."""
    torch.manual_seed(0)
    cfg = models.ConvNetConfig(image_size=16, channels=(4, 8), blocks_per_stage=1, num_classes=5, dropout=0.0)
    model = models.build_model(cfg)
    batch = models.make_batch(model, batch_size=4, image_size=16)
    loss_fn = models.loss_fn_for(model)
    ref = copy.deepcopy(model)
    plan = remat.solve(remat.profile(model, batch, loss_fn=loss_fn, repeats=1), method="all", budget=None)
    remat.apply(model, plan)
    assert_grads_close(torch.compile(model, fullgraph=True), ref, batch, loss_fn)
    buffers = dict(ref.named_buffers())
    assert any(name.endswith("num_batches_tracked") for name in buffers)
    for name, buf in model.named_buffers():
        torch.testing.assert_close(buf, buffers[name], rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
