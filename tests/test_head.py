"""remat.chunked_cross_entropy and the chunked head of transformers causal LMs, against plain PyTorch."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import remat
from remat.errors import InvalidType, InvalidValue
from remat.manual.head import head_chunk_of, noting_heads, set_head_chunk
from remat.manual.lm_head import causal_lm_head, chunk_of_option, clear_head, set_head

V, H = 300, 16


def _setup(bias: bool = True, seed: int = 0) -> tuple[torch.Tensor, nn.Linear, torch.Tensor]:
    torch.manual_seed(seed)
    hidden = torch.randn(2, 25, H, requires_grad=True)
    head = nn.Linear(H, V, bias=bias)
    targets = torch.randint(0, V, (2, 25))
    targets[0, 3] = targets[1, 0] = -100
    return hidden, head, targets


def _grads(loss: torch.Tensor, hidden: torch.Tensor, head: nn.Linear) -> list[torch.Tensor]:
    (loss.sum() if loss.dim() else loss).backward()
    out = [hidden.grad.clone(), head.weight.grad.clone()]
    out += [head.bias.grad.clone()] if head.bias is not None else []
    hidden.grad = None
    head.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("shift", [False, True])
@pytest.mark.parametrize("bias", [True, False])
def test_equals_plain_cross_entropy(reduction: str, shift: bool, bias: bool) -> None:
    hidden, head, targets = _setup(bias)
    loss = remat.chunked_cross_entropy(hidden, head, targets, chunk_size=7, reduction=reduction,
                                       shift=shift)  # fmt: skip
    got = _grads(loss, hidden, head)
    shifted = F.pad(targets[:, 1:], (0, 1), value=-100) if shift else targets
    plain = F.cross_entropy(head(hidden).float().reshape(-1, V), shifted.reshape(-1), reduction=reduction)
    plain = plain.reshape(targets.shape) if reduction == "none" else plain
    want = _grads(plain, hidden, head)
    assert loss.shape == plain.shape
    torch.testing.assert_close(loss, plain.detach())
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


def test_weight_tensor_and_chunk_sizes_agree() -> None:
    hidden, head, targets = _setup(bias=False)
    losses = [remat.chunked_cross_entropy(hidden, head.weight, targets, chunk_size=c) for c in (1, 13, 50, 999)]
    for loss in losses[1:]:
        torch.testing.assert_close(loss, losses[0])
    want = F.cross_entropy((hidden @ head.weight.t()).reshape(-1, V), targets.reshape(-1))
    torch.testing.assert_close(losses[0], want)


def test_under_autocast_bf16() -> None:
    hidden, head, targets = _setup()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = remat.chunked_cross_entropy(hidden, head, targets, chunk_size=8)
        got = _grads(loss, hidden, head)
        plain = F.cross_entropy(head(hidden).float().reshape(-1, V), targets.reshape(-1))
        want = _grads(plain, hidden, head)
    torch.testing.assert_close(loss, plain.detach())  # the same bf16 logits, so equal
    for g, w in zip(got, want):  # bf16 round-off in the gradients' sums
        torch.testing.assert_close(g, w, rtol=0.02, atol=0.02 * w.abs().max().item())


def test_all_ignored_is_nan_as_plain() -> None:
    hidden, head, targets = _setup()
    targets = torch.full_like(targets, -100)
    loss = remat.chunked_cross_entropy(hidden, head, targets)
    assert torch.isnan(loss) and torch.isnan(F.cross_entropy(head(hidden).reshape(-1, V), targets.reshape(-1)))


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        (lambda h, w, t: (h, w, t.float()), InvalidType, "int64 tensor"),
        (lambda h, w, t: (h.long(), w, t), InvalidType, "floating-point"),
        (lambda h, w, t: (h, w, t[:, :-1]), InvalidValue, "do not match hidden states"),
        (lambda h, w, t: (h[..., :-1], w, t), InvalidValue, r"expected \[vocab, 15\]"),
        (lambda h, w, t: (h, nn.ReLU(), t), InvalidType, "without a weight"),
        (lambda h, w, t: (h, "head", t), InvalidType, "nn.Linear-like"),
        (lambda h, w, t: (h, w, t + V), InvalidValue, "out of range"),
    ],
)
def test_bad_inputs_teach(change, error, match) -> None:  # type: ignore[no-untyped-def]
    hidden, head, targets = _setup()
    h, w, t = change(hidden, head, targets.clamp(min=0))
    with pytest.raises(error, match=match):
        remat.chunked_cross_entropy(h, w, t)


@pytest.mark.parametrize("kwargs", [{"chunk_size": 0}, {"chunk_size": True}, {"reduction": "avg"}])
def test_bad_options_teach(kwargs: dict) -> None:
    hidden, head, targets = _setup()
    with pytest.raises(InvalidValue, match="chunk_size must be|reduction must be"):
        remat.chunked_cross_entropy(hidden, head, targets, **kwargs)


def _step_peak(fn) -> int:  # type: ignore[no-untyped-def]
    from remat.measure.tracer import MemoryTracer

    with MemoryTracer("cpu") as tracer:
        fn().backward()
    return tracer.trace.peak_bytes


def test_measured_bytes_one_chunk_instead_of_all_logits() -> None:
    torch.manual_seed(0)
    tokens, vocab = 2048, 8192
    hidden = torch.randn(tokens, 32, requires_grad=True)
    head = nn.Linear(32, vocab, bias=False)
    targets = torch.randint(0, vocab, (tokens,))
    logits_bytes = tokens * vocab * 4
    plain = _step_peak(lambda: F.cross_entropy(head(hidden).float(), targets))
    chunked = _step_peak(lambda: remat.chunked_cross_entropy(hidden, head, targets, chunk_size=256))
    assert plain >= 2 * logits_bytes  # the logits and their gradient at least
    assert chunked < plain / 4
    assert chunked < 5 * 256 * vocab * 4 + 4 * head.weight.numel() + 8 * tokens * 32


def test_a_planned_chunk_size_overrides_the_call_and_is_noted() -> None:
    hidden, head, targets = _setup()
    with noting_heads() as seen:
        remat.chunked_cross_entropy(hidden, head, targets)
        remat.chunked_cross_entropy(hidden, head, targets)
    assert seen == [(head, 50)]
    set_head_chunk(head, 5)
    assert head_chunk_of(head) == 5
    torch.testing.assert_close(
        remat.chunked_cross_entropy(hidden, head, targets, chunk_size=1000),
        F.cross_entropy(head(hidden).reshape(-1, V), targets.reshape(-1)),
    )
    set_head_chunk(head, None)
    assert head_chunk_of(head) is None and "_remat_head_chunk" not in head.__dict__


def test_head_option_names() -> None:
    assert chunk_of_option("keep") is None and chunk_of_option("chunked:64") == 64
    for bad in ("chunked:0", "chunked", "chunk:8", "fast"):
        with pytest.raises(InvalidValue, match="expected 'keep' or 'chunked:<tokens>'"):
            chunk_of_option(bad)


# --- transformers causal LMs --------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_causal_lm_loss_and_grads_equal_plain(kind: str) -> None:
    from remat.models.hf import build

    model, batch, _ = build(kind, batch_size=2, seq_len=24)
    name = causal_lm_head(model)
    assert name == "lm_head"
    before = copy.deepcopy(model.state_dict())
    torch.manual_seed(0)
    out = model(**batch)
    out.loss.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    set_head(model, name, "chunked:7", causal_lm=True)
    torch.manual_seed(0)  # dropout: the same random numbers
    got = model(**batch)
    got.loss.backward()
    assert got.logits is None
    torch.testing.assert_close(got.loss, out.loss.detach())
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[n], msg=n)
    # num_items_in_batch: the sum over the tokens divided by it, as transformers does
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    summed = model(**batch, num_items_in_batch=torch.tensor(10))
    torch.manual_seed(0)
    as_tuple = model(**batch, return_dict=False)
    torch.testing.assert_close(as_tuple[0], out.loss.detach())
    model.eval()
    assert model(**batch).logits is not None  # eval: the model's own forward
    model.train()
    clear_head(model, name)
    assert "forward" not in model.__dict__ and "_remat_head_chunk" not in model.lm_head.__dict__
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    torch.manual_seed(0)
    plain_sum = model(**batch, num_items_in_batch=torch.tensor(10))
    torch.testing.assert_close(summed.loss, plain_sum.loss, rtol=1e-5, atol=1e-5)


def test_a_mixture_of_experts_keeps_its_router_loss_under_the_chunked_head() -> None:
    """NOTE [ The chunked head of a transformers causal LM ]: run with ``labels=None``, Mixtral left
    out its router's balancing loss (0.0200 of 6.2702) and its routers' gradients differed; the
    plan also measured 8,192 B over its prediction."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(transformers.MixtralConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, output_router_logits=True,
        router_aux_loss_coef=0.01)).train()
    ids = torch.randint(0, 128, (2, 32))
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    assert out.aux_loss > 0
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    set_head(model, "lm_head", "chunked:16", causal_lm=True)
    got = model(input_ids=ids, labels=ids)
    got.loss.backward()
    torch.testing.assert_close(got.loss, out.loss.detach())
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[n], msg=n)
    as_tuple = model(input_ids=ids, labels=ids, return_dict=False)
    torch.testing.assert_close(as_tuple[0], out.loss.detach())
    assert not any(torch.is_tensor(t) and t.dim() == 3 for t in as_tuple)  # no logits
    clear_head(model, "lm_head")
    assert "_loss_function" not in model.__dict__ and "forward" not in model.__dict__


def test_models_that_transform_logits_get_no_head_option() -> None:
    from remat.models.hf import build

    model, _, _ = build("llama", batch_size=1, seq_len=8)
    model.config.final_logit_softcapping = 30.0
    assert causal_lm_head(model) is None
    assert causal_lm_head(nn.Linear(2, 2)) is None


def test_causal_lms_with_their_own_loss_get_no_head_option() -> None:
    """XLNet's LM head model computes its loss without the causal shift: a chunked head gave it
    another loss (3.59 became 4.15). Only a forward with transformers' causal LM loss is offered."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    xlnet = transformers.XLNetLMHeadModel(transformers.XLNetConfig(
        vocab_size=64, d_model=32, n_layer=2, n_head=4, d_inner=64, dropout=0.0, bos_token_id=1, eos_token_id=2,
        pad_token_id=0))
    assert causal_lm_head(xlnet) is None
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2,
                                                                bos_token_id=0, eos_token_id=0))
    assert causal_lm_head(gpt2) == "lm_head"
    ids = torch.randint(0, 64, (2, 16))
    plain = xlnet(input_ids=ids, labels=ids).loss
    prof = remat.profile(xlnet, {"input_ids": ids, "labels": ids}, repeats=1)
    assert prof.head_options == {} or not prof.head_causal_lm
    assert torch.equal(xlnet(input_ids=ids, labels=ids).loss, plain)
