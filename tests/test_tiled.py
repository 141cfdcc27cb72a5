"""The ``tiled`` option (a block kept, its MLP in sequence tiles, recomputed), against plain PyTorch."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch import nn

import remat
from remat import models
from remat.errors import BlockError
from remat.manual.options import clear_option, option_of, set_option
from remat.manual.tiled import find_mlp, tiles
from remat.plan.solver import solve
from remat.vocabulary import CHECKPOINT_OPTIONS, OPTIONS
from tests._tables import block, cost, profile


def test_tiled_is_an_option_but_no_checkpoint_mode() -> None:
    assert "tiled" in OPTIONS and "tiled" not in CHECKPOINT_OPTIONS
    assert tiles(8192, 4096) == 2 and tiles(384, 64) == 6 and tiles(10, 64) == 2


def _grads(model: nn.Module, run) -> tuple[torch.Tensor, list[torch.Tensor]]:  # type: ignore[no-untyped-def]
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    loss = run()
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def _llama() -> tuple[nn.Module, torch.Tensor]:
    cfg = models.LlamaConfig(n_layer=2, dim=32, ffn_dim=96, n_head=2, n_kv_head=1, vocab_size=64, max_seq=64)
    torch.manual_seed(0)
    return models.build_model(cfg), torch.randint(0, 64, (2, 50))


def test_remat_llama_tiled_equals_plain_and_is_undone() -> None:
    model, ids = _llama()
    loss_fn = models.loss_fn_for(model)
    want = _grads(model, lambda: loss_fn(model(ids), (ids,)))
    layers = list(model.layers)
    for layer in layers:
        assert isinstance(find_mlp(layer), models.decoders.SwiGLU)
        set_option(layer, "tiled")
        assert option_of(layer) == "tiled"
    calls = []
    handle = layers[0].mlp.register_forward_hook(lambda m, a, o: calls.append(a[0].shape[1]))
    got = _grads(model, lambda: loss_fn(model(ids), (ids,)))
    handle.remove()
    assert calls == [50]  # hooks see the MLP's one call, with the whole sequence
    torch.testing.assert_close(got[0], want[0])
    for g, w in zip(got[1], want[1]):
        torch.testing.assert_close(g, w)
    for layer in layers:
        set_option(layer, "recompute")  # another option replaces tiled
        assert option_of(layer) == "recompute" and "forward" not in layer.mlp.__dict__
        clear_option(layer)
        assert option_of(layer) == "keep"


def test_transformers_llama_layers_tiled_equal_plain() -> None:
    from remat.models.hf import build

    model, batch, _ = build("llama", batch_size=2, seq_len=40, attention_dropout=0.0)
    want = _grads(model, lambda: model(**batch).loss)
    before = copy.deepcopy(model.state_dict())
    prof_blocks = [m for n, m in model.named_modules() if n.startswith("model.layers.") and n.count(".") == 2]
    for layer in prof_blocks:
        set_option(layer, "tiled")
    got = _grads(model, lambda: model(**batch).loss)
    torch.testing.assert_close(got[0], want[0])
    for g, w in zip(got[1], want[1]):
        torch.testing.assert_close(g, w)
    remat.remove(model)
    assert all(option_of(layer) == "keep" for layer in prof_blocks)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_not_offered_without_an_mlp_or_with_dropout() -> None:
    cfg = models.GPTConfig(n_layer=1, n_embd=32, n_head=2, block_size=16, vocab_size=32, dropout=0.1)
    gpt = models.build_model(cfg)
    assert find_mlp(gpt.blocks[0]) is None
    assert find_mlp(nn.Linear(3, 3)) is None
    with pytest.raises(BlockError, match="option 'tiled' needs an MLP without dropout"):
        set_option(nn.Sequential(nn.Linear(3, 3)), "tiled")


def test_profile_measures_tiled_and_kept_bytes_drop() -> None:
    model, ids = _llama()
    prof = remat.profile(model, (ids,), loss_fn=models.loss_fn_for(model), repeats=1)
    assert prof.options == ("keep", "tiled", "selective", "recompute")
    for b in prof.blocks:
        tiled, keep = b.options["tiled"], b.options["keep"]
        assert tiled.kept_bytes < keep.kept_bytes and tiled.extra_ms > 0
        # the MLP's intermediates: gate, up, silu(gate), their product, fp32 [2, 50, 96] each
        assert keep.kept_bytes - tiled.kept_bytes >= 3 * 2 * 50 * 96 * 4
    plan = dataclasses.replace(solve(prof, method="none"), choices={b.name: "tiled" for b in prof.blocks})
    remat.apply(model, plan)
    assert all(option_of(m) == "tiled" for m in model.layers)
    remat.remove(model)
    assert all(option_of(m) == "keep" for m in model.layers)


def test_a_block_without_an_mlp_does_not_take_tiled_from_the_others() -> None:
    # STANDS_IN in remat.vocabulary: a patch embedding (no MLP) among layers that offer tiled
    # runs kept where a plan chooses tiled; before, tiled was left out for every block, and
    # a CLIP's floor rose 0.9% when its vision embeddings became a block
    layers = [block(f"b{i}", keep=cost(100), tiled=cost(60, ms=1.0), recompute=cost(10, ms=5.0)) for i in range(3)]
    prof = profile([block("embed", keep=cost(20), recompute=cost(5, ms=1.0)), *layers])
    plan = solve(prof, 240)
    assert plan.choices["embed"] == "keep" and sorted(plan.choices.values()) == ["keep", "keep", "tiled", "tiled"]
    assert plan.estimate == remat.estimate(prof, plan.choices)
    assert not plan.notes


def test_the_solver_takes_tiled_where_it_is_the_cheapest_fit() -> None:
    blocks = [block(f"b{i}", keep=cost(100), tiled=cost(60, ms=1.0), recompute=cost(10, ms=5.0)) for i in range(3)]
    prof = profile(blocks)
    assert list(solve(prof, 300).choices.values()) == ["keep"] * 3
    plan = solve(prof, 220)
    assert sorted(plan.choices.values()) == ["keep", "tiled", "tiled"]  # 2 ms beats one recompute's 5
    assert plan.estimate.peak_bytes == 220


class _Layer(nn.Module):
    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.SiLU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


def _wrapped_lm(vocab: int = 512, d: int = 32) -> nn.Module:
    """Layers under torch's ``checkpoint_wrapper``, as torchtune's and torchtitan's activation
    checkpointing leaves them: ``layer.mlp`` reaches the wrapped module's MLP."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(vocab, d), *[checkpoint_wrapper(_Layer(d)) for _ in range(4)],
                         nn.Linear(d, vocab, bias=False))


def test_a_wrapped_blocks_mlp_is_untiled_where_it_was_tiled() -> None:
    model = _wrapped_lm()
    ids = torch.randint(0, 512, (2, 64))
    run = lambda: nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten())  # noqa: E731
    want = _grads(model, run)
    block = model[1]
    assert find_mlp(block) is block._checkpoint_wrapped_module.mlp  # through the wrapper's attributes
    set_option(block, "tiled")
    assert option_of(block) == "tiled"
    got = _grads(model, run)
    torch.testing.assert_close(got[0], want[0])
    for g, w in zip(got[1], want[1]):
        torch.testing.assert_close(g, w)
    clear_option(block)  # remat.remove's: the MLP's own forward again
    assert option_of(block) == "keep" and not [n for n, m in model.named_modules() if "forward" in m.__dict__]


def test_a_lean_profile_of_wrapped_blocks_predicts_its_plan() -> None:
    # The fake copy's MLPs were left tiled after the profiler measured the option (untile looked at
    # the wrapper's children only), so every fake twin of a real step ran them tiled: each block was
    # charged 40,448 B less than it keeps, and a plan under the plain step measured over its budget.
    model = _wrapped_lm(vocab=4096, d=64)
    ids = torch.randint(0, 4096, (4, 64))
    loss_fn = lambda out, b: nn.functional.cross_entropy(out[:, :-1].flatten(0, 1), b[:, 1:].flatten())  # noqa: E731
    plain = remat.measure_step(model, ids, loss_fn=loss_fn, repeats=0).peak_bytes
    plan = remat.auto(model, ids, plain - 100_000, loss_fn=loss_fn, repeats=1)
    assert not plan.plain_ran and plan.estimate is not None
    measured = remat.measure_step(model, ids, loss_fn=loss_fn, repeats=0).peak_bytes
    remat.remove(model)
    assert measured <= plan.estimate.peak_bytes <= plain - 100_000, (measured, plan.estimate.peak_bytes, plan.choices)
    assert not [n for n, m in model.named_modules() if "forward" in m.__dict__]
