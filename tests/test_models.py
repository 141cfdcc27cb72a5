"""Built-in models and the zoo: shapes, gradients, determinism, dtypes, fake mode, named sizes."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from remat.models import (
    GPT,
    BertConfig,
    ConvNet,
    ConvNetConfig,
    GPTConfig,
    Llama,
    LlamaConfig,
    ModelConfig,
    ResBlock,
    ViTConfig,
    build_model,
    lm_loss,
    loss_fn_for,
    make_batch,
    zoo,
)

TINY: dict[str, ModelConfig] = {
    "gpt": GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32),
    "llama": LlamaConfig(vocab_size=64, max_seq=16, n_layer=2, n_head=4, n_kv_head=2, dim=32,
                         ffn_dim=48, dropout=0.1),
    "convnet": ConvNetConfig(image_size=16, channels=(4, 8), blocks_per_stage=1, num_classes=5),
    "bert": BertConfig(vocab_size=64, max_seq=16, n_layer=2, n_head=2, dim=32, ffn_dim=64),
    "vit": ViTConfig(image_size=16, patch_size=4, n_layer=2, n_head=2, dim=32, ffn_dim=64,
                     num_classes=5),
}
# Output shape for a batch of 3 (token models at 8 tokens).
OUT_SHAPE = {"gpt": (3, 8, 64), "llama": (3, 8, 64), "convnet": (3, 5), "bert": (3, 8, 64),
             "vit": (3, 5)}


def _size(name: str) -> dict[str, Any]:
    """make_batch/spec options for a small batch of TINY[name]."""
    return {} if name in ("convnet", "vit") else {"seq_len": 8}


def _step(name: str) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    cfg = TINY[name]
    torch.manual_seed(0)
    model = build_model(cfg)
    batch = make_batch(cfg, batch_size=3, generator=torch.Generator().manual_seed(1), **_size(name))
    out = model(*batch)
    loss = loss_fn_for(model)(out, batch)
    loss.backward()
    return model, out, loss


@pytest.mark.parametrize("name", list(TINY))
def test_forward_backward_shapes_and_grads(name: str) -> None:
    model, out, loss = _step(name)
    assert tuple(out.shape) == OUT_SHAPE[name]
    assert loss.dim() == 0 and torch.isfinite(loss)
    for pname, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), pname


@pytest.mark.parametrize("name", list(TINY))
def test_deterministic_under_seed(name: str) -> None:
    m1, out1, loss1 = _step(name)
    m2, out2, loss2 = _step(name)
    assert torch.equal(out1, out2) and torch.equal(loss1, loss2)
    for (n1, p1), (_, p2) in zip(m1.named_parameters(), m2.named_parameters()):
        assert p1.grad is not None and p2.grad is not None
        assert torch.equal(p1, p2) and torch.equal(p1.grad, p2.grad), n1


@pytest.mark.parametrize("name", list(TINY))
def test_bf16_parameters_and_autocast(name: str) -> None:
    cfg = TINY[name]
    model = build_model(cfg, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    batch = make_batch(cfg, batch_size=2, dtype=torch.bfloat16, **_size(name))
    out = model(*batch)
    assert out.dtype == torch.bfloat16
    loss_fn_for(cfg)(out, batch).backward()
    assert all(p.grad is not None and p.grad.dtype == torch.bfloat16 for p in model.parameters())

    model = build_model(cfg)
    batch = make_batch(cfg, batch_size=2, **_size(name))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = loss_fn_for(cfg)(model(*batch), batch)
    loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())


def test_dropout_only_in_training() -> None:
    model = build_model(TINY["gpt"])
    (ids,) = make_batch(model, batch_size=2, seq_len=8)
    assert not torch.equal(model(ids), model(ids))
    model.eval()
    assert torch.equal(model(ids), model(ids))


def test_lm_loss_is_next_token_cross_entropy() -> None:
    logits = torch.randn(2, 5, 7)
    ids = torch.randint(7, (2, 5))
    expected = F.cross_entropy(logits[:, :-1].reshape(-1, 7), ids[:, 1:].reshape(-1))
    torch.testing.assert_close(lm_loss(logits, (ids,)), expected)


def test_gpt_rejects_sequence_longer_than_block_size() -> None:
    model = GPT(TINY["gpt"])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="longer than block_size=16"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_llama_masks_and_long_sequences() -> None:
    torch.manual_seed(0)
    model = Llama(LlamaConfig(vocab_size=64, max_seq=16, n_layer=2, n_head=4, n_kv_head=2,
                              dim=32, ffn_dim=48)).eval()
    ids = torch.randint(64, (2, 8))
    causal = model(ids)
    torch.testing.assert_close(model(ids, torch.ones(2, 8, dtype=torch.bool)), causal)
    four_d = torch.ones(8, 8, dtype=torch.bool).tril()[None, None]
    torch.testing.assert_close(model(ids, four_d), causal)
    # Left padding: the real tokens of row 0 must not see the padded ones; outputs stay finite.
    pad = torch.ones(2, 8, dtype=torch.bool)
    pad[0, :3] = False
    out = model(ids, pad)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[1], causal[1])
    torch.testing.assert_close(out[0, 3:], model(ids[:1, 3:])[0])
    # Rotary positions: longer than max_seq still runs.
    assert model(torch.randint(64, (1, 40))).shape == (1, 40, 64)


def test_convnet_is_a_sequential_of_blocks_of_different_sizes() -> None:
    model = ConvNet(ConvNetConfig())
    assert isinstance(model, nn.Sequential)
    blocks = [m for m in model if isinstance(m, ResBlock)]
    assert len(blocks) == len(model) - 2 == 6
    (images,) = make_batch(model, batch_size=2)
    sizes = []
    x = model[0](images)
    for block in blocks:
        x = block(x)
        sizes.append(x.numel())
    assert sizes == [2 * 16 * 64 * 64] * 2 + [2 * 32 * 32 * 32] * 2 + [2 * 64 * 16 * 16] * 2
    bn = model[0][1]  # type: ignore[index]
    before = bn.num_batches_tracked.item()
    model(images)
    assert bn.num_batches_tracked.item() == before + 1


@pytest.mark.parametrize("name", list(TINY))
def test_spec_builds_and_runs_under_fake_tensor_mode(name: str) -> None:
    s = zoo.spec(TINY[name], batch_size=2, dtype=torch.bfloat16, **_size(name))
    with FakeTensorMode():
        model, batch = s.make_model(), s.make_batch()
        out = model(*batch)
        s.loss_fn(out, batch).backward()
    assert all(p.grad is not None for p in model.parameters())


def test_fake_mode_big_model_and_long_rope_sequence() -> None:
    s = zoo.spec("llama-1b", seq_len=200_000)  # beyond max_seq: rotary positions go on
    with FakeTensorMode():
        model, batch = s.make_model(), s.make_batch()
        out = model(*batch)
    assert out.shape == (1, 200_000, 128256)


def test_spec_is_deterministic_and_leaves_the_global_rng_alone() -> None:
    s = zoo.spec("gpt-tiny", batch_size=2, seq_len=8, seed=3)
    state = torch.get_rng_state()
    m1, m2 = s.make_model(), s.make_model()
    assert torch.equal(torch.get_rng_state(), state)
    assert all(torch.equal(a, b) for a, b in zip(m1.state_dict().values(), m2.state_dict().values()))
    assert torch.equal(s.make_batch()[0], s.make_batch()[0])
    other = zoo.spec("gpt-tiny", batch_size=2, seq_len=8, seed=4).make_model()
    assert not torch.equal(other.state_dict()["wte.weight"], m1.state_dict()["wte.weight"])


def test_build_defaults() -> None:
    model, batch, loss_fn = zoo.build("gpt-tiny")
    assert batch[0].shape == (8, 128) and loss_fn is lm_loss
    model, batch, loss_fn = zoo.build("convnet")
    assert batch[0].shape == (16, 3, 64, 64) and isinstance(model, ConvNet)
    model, batch, _ = zoo.build(TINY["llama"], seq_len=4)
    assert batch[0].shape == (1, 4)


@pytest.mark.parametrize("name", [n for n in zoo.names() if zoo.ZOO[n].nominal_params])
def test_zoo_parameter_counts_match_their_sources(name: str) -> None:
    entry = zoo.ZOO[name]
    model = build_model(entry.config, device="meta")  # shapes only: no memory, no init cost
    count = sum(p.numel() for p in model.parameters())
    assert entry.nominal_params is not None
    assert abs(count / entry.nominal_params - 1) < 0.015, f"{name}: {count:,}"


def test_spot_check_parameter_counts() -> None:
    def count(name: str) -> float:
        model = build_model(zoo.ZOO[name].config, device="meta")
        return sum(p.numel() for p in model.parameters()) / 1e9

    assert count("gpt2") == pytest.approx(0.124, rel=0.01)
    assert count("llama-7b") == pytest.approx(6.74, rel=0.01)
    assert count("llama-8b") == pytest.approx(8.03, rel=0.01)


def test_zoo_names_and_sources() -> None:
    names = zoo.names()
    for expected in ["gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl", "llama-1b", "llama-3b",
                     "llama-7b", "llama-8b", "llama-13b", "llama-70b", "bert-base", "bert-large",
                     "vit-b", "vit-l", "gpt-tiny", "llama-tiny", "convnet"]:
        assert expected in names
    assert all(zoo.ZOO[n].source for n in names)


def test_unknown_name_error_suggests_and_lists() -> None:
    with pytest.raises(ValueError) as err:
        zoo.spec("llama-8")
    text = str(err.value)
    assert text.startswith("unknown model 'llama-8'; did you mean 'llama-8b'?")
    assert "gpt2-xl" in text and "vit-l" in text
    with pytest.raises(ValueError, match="unknown model 'resnet'") as err:
        zoo.build("resnet")
    assert "did you mean" not in str(err.value)


def test_spec_validates_options() -> None:
    with pytest.raises(ValueError, match="learned position embeddings for 1024 positions"):
        zoo.spec("gpt2", seq_len=2048)
    with pytest.raises(ValueError, match="learned position embeddings for 512 positions"):
        zoo.spec("bert-base", seq_len=1024)
    assert zoo.spec("llama-7b", seq_len=16384).seq_len == 16384
    with pytest.raises(ValueError, match="image model: give image_size"):
        zoo.spec("vit-b", seq_len=196)
    with pytest.raises(ValueError, match="takes token ids"):
        zoo.spec("gpt2", image_size=224)
    with pytest.raises(ValueError, match="batch_size must be at least 1"):
        zoo.spec("gpt2", batch_size=0)
    with pytest.raises(ValueError, match="floating point"):
        zoo.spec("gpt2", dtype=torch.int64)
    with pytest.raises(ValueError, match="does not divide image_size"):
        zoo.spec("vit-b", image_size=100)
    with pytest.raises(TypeError, match="zoo name"):
        zoo.spec(3)  # type: ignore[arg-type]
    assert zoo.spec("vit-b", image_size=384).config.image_size == 384  # type: ignore[union-attr]
