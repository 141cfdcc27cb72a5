"""Tiny transformers models of many families, built offline from configs (random init).

``ZOO[name]()`` gives ``(model, batch, stacks)``: the model in training mode, a batch that makes
the model compute its own loss (``model(**batch).loss``), and the containers whose children are
the blocks remat should find (in definition order). Every model has 2 layers per stack, width
32-64 and short sequences, so that a CPU step takes milliseconds. Randomness that is not
torch's (SpecAugment masks drawn with numpy) is off, so that two steps on one seed match.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

Built = tuple[nn.Module, dict[str, torch.Tensor], tuple[str, ...]]

VOCAB = 64
BATCH = 4
SEQ = 32
LAYERS = 4
"""Layers of a model with one stack; a model with two has 2 in each. With fewer, no plan reaches
60% of the plain peak: recomputing one of two blocks saves at most half of the activations."""
_IDS = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}


def _tf() -> Any:
    import transformers

    return transformers


def _made(model_cls: str, cfg: Any, batch: dict[str, torch.Tensor], stacks: tuple[str, ...]) -> Built:
    torch.manual_seed(0)
    model = getattr(_tf(), model_cls)(cfg)
    model.train()
    return model, batch, stacks


def _ids(seq: int = SEQ, vocab: int = VOCAB) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(3, vocab, (BATCH, seq), generator=g)


def _lm(model_cls: str, cfg: Any, stacks: tuple[str, ...]) -> Built:
    ids = _ids()
    return _made(model_cls, cfg, {"input_ids": ids, "labels": ids}, stacks)


def _pixels(size: int = 16, channels: int = 3) -> torch.Tensor:
    return torch.randn(BATCH, channels, size, size, generator=torch.Generator().manual_seed(1))


# --- decoder-only ---------------------------------------------------------------------------------


def llama() -> Built:  # GQA, rotary
    cfg = _tf().LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, **_IDS)
    return _lm("LlamaForCausalLM", cfg, ("model.layers",))


def mistral() -> Built:  # GQA, sliding window shorter than the sequence
    cfg = _tf().MistralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                              max_position_embeddings=64, sliding_window=8, **_IDS)
    return _lm("MistralForCausalLM", cfg, ("model.layers",))


def gemma() -> Built:  # multi-query attention, rotary, use_cache on by default
    cfg = _tf().GemmaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
                            num_attention_heads=4, num_key_value_heads=1, head_dim=8,
                            max_position_embeddings=64, **_IDS)
    return _lm("GemmaForCausalLM", cfg, ("model.layers",))


def qwen2() -> Built:
    cfg = _tf().Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, **_IDS)
    return _lm("Qwen2ForCausalLM", cfg, ("model.layers",))


def bloom() -> Built:  # ALiBi
    cfg = _tf().BloomConfig(vocab_size=VOCAB, hidden_size=32, n_layer=LAYERS, n_head=4, **_IDS)
    return _lm("BloomForCausalLM", cfg, ("transformer.h",))


def falcon() -> Built:  # ALiBi, multi-query
    cfg = _tf().FalconConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=LAYERS, num_attention_heads=4,
                             alibi=True, multi_query=True, new_decoder_architecture=False, **_IDS)
    return _lm("FalconForCausalLM", cfg, ("transformer.h",))


def gpt_neox() -> Built:  # rotary on part of each head
    cfg = _tf().GPTNeoXConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
                              num_attention_heads=4, max_position_embeddings=64, rotary_pct=0.5, **_IDS)
    return _lm("GPTNeoXForCausalLM", cfg, ("gpt_neox.layers",))


def phi() -> Built:  # partial rotary, parallel attention and MLP
    cfg = _tf().PhiConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
                          num_attention_heads=4, max_position_embeddings=64, partial_rotary_factor=0.5, **_IDS)
    return _lm("PhiForCausalLM", cfg, ("model.layers",))


def gpt2() -> Built:
    cfg = _tf().GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=LAYERS, n_head=4, **_IDS)
    return _lm("GPT2LMHeadModel", cfg, ("transformer.h",))


def gpt_bigcode() -> Built:  # multi-query
    cfg = _tf().GPTBigCodeConfig(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=LAYERS, n_head=4,
                                 multi_query=True, **_IDS)
    return _lm("GPTBigCodeForCausalLM", cfg, ("transformer.h",))


# --- mixture of experts ---------------------------------------------------------------------------


def mixtral() -> Built:
    cfg = _tf().MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
                              num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                              num_experts_per_tok=2, max_position_embeddings=64, **_IDS)
    return _lm("MixtralForCausalLM", cfg, ("model.layers",))


def qwen2_moe() -> Built:  # routed experts and a shared one
    cfg = _tf().Qwen2MoeConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
                               num_attention_heads=4, num_key_value_heads=2, num_experts=4,
                               num_experts_per_tok=2, moe_intermediate_size=32,
                               shared_expert_intermediate_size=32, max_position_embeddings=64, **_IDS)
    return _lm("Qwen2MoeForCausalLM", cfg, ("model.layers",))


# --- encoder-only ---------------------------------------------------------------------------------


def _mlm(model_cls: str, cfg: Any, stacks: tuple[str, ...]) -> Built:
    ids = _ids()
    labels = torch.full_like(ids, -100)
    labels[:, ::5] = ids[:, ::5]
    inputs = ids.clone()
    inputs[:, ::5] = 3
    return _made(model_cls, cfg, {"input_ids": inputs, "labels": labels}, stacks)


def bert() -> Built:  # absolute positions
    cfg = _tf().BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=LAYERS, num_attention_heads=4,
                           intermediate_size=64, max_position_embeddings=64, pad_token_id=0)
    return _mlm("BertForMaskedLM", cfg, ("bert.encoder.layer",))


def deberta_v2() -> Built:  # disentangled relative positions, shared across layers
    cfg = _tf().DebertaV2Config(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=LAYERS, num_attention_heads=4,
                                intermediate_size=64, max_position_embeddings=64, relative_attention=True,
                                position_buckets=16, pos_att_type=["p2c", "c2p"], pad_token_id=0)
    return _mlm("DebertaV2ForMaskedLM", cfg, ("deberta.encoder.layer",))


# --- encoder-decoder ------------------------------------------------------------------------------


def _seq2seq(model_cls: str, cfg: Any, stacks: tuple[str, ...]) -> Built:
    ids = _ids()
    labels = _ids(seq=SEQ // 2).flip(0)
    return _made(model_cls, cfg, {"input_ids": ids, "labels": labels}, stacks)


def t5() -> Built:  # relative position buckets, computed in the first block of each stack
    cfg = _tf().T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                         relative_attention_num_buckets=8, decoder_start_token_id=0, **_IDS)
    return _seq2seq("T5ForConditionalGeneration", cfg, ("encoder.block", "decoder.block"))


def bart() -> Built:
    cfg = _tf().BartConfig(vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2,
                           encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                           decoder_ffn_dim=64, max_position_embeddings=64, decoder_start_token_id=2, **_IDS)
    return _seq2seq("BartForConditionalGeneration", cfg, ("model.encoder.layers", "model.decoder.layers"))


# --- speech ---------------------------------------------------------------------------------------


def whisper() -> Built:
    cfg = _tf().WhisperConfig(vocab_size=VOCAB, num_mel_bins=8, d_model=32, encoder_layers=2, decoder_layers=2,
                              encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                              decoder_ffn_dim=64, max_source_positions=32, max_target_positions=32,
                              decoder_start_token_id=1, suppress_tokens=None, begin_suppress_tokens=None, **_IDS)
    features = torch.randn(BATCH, 8, 64, generator=torch.Generator().manual_seed(1))
    batch = {"input_features": features, "labels": _ids(seq=SEQ // 2)}
    return _made("WhisperForConditionalGeneration", cfg, batch, ("model.encoder.layers", "model.decoder.layers"))


def wav2vec2(layerdrop: float = 0.0, layers: int = 2) -> Built:
    """Wav2Vec2 for CTC; its default layerdrop is 0.1, off here (remat plans with it off: see the
    layerdrop tests)."""
    cfg = _tf().Wav2Vec2Config(vocab_size=16, hidden_size=32, num_hidden_layers=layers, num_attention_heads=4,
                               intermediate_size=64, conv_dim=(16, 16, 16), conv_kernel=(10, 3, 3),
                               conv_stride=(5, 4, 2), num_conv_pos_embeddings=8, num_conv_pos_embedding_groups=4,
                               mask_time_prob=0.0, mask_feature_prob=0.0, ctc_loss_reduction="mean",
                               layerdrop=layerdrop, pad_token_id=0)
    audio = torch.randn(BATCH, 1600, generator=torch.Generator().manual_seed(1))
    labels = torch.randint(1, 16, (BATCH, 6), generator=torch.Generator().manual_seed(2))
    batch = {"input_values": audio, "labels": labels}
    return _made("Wav2Vec2ForCTC", cfg, batch, ("wav2vec2.feature_extractor.conv_layers", "wav2vec2.encoder.layers"))


# --- vision ---------------------------------------------------------------------------------------


def _classify(model_cls: str, cfg: Any, stacks: tuple[str, ...], size: int = 32) -> Built:
    batch = {"pixel_values": _pixels(size), "labels": torch.arange(BATCH) % 4}
    return _made(model_cls, cfg, batch, stacks)


def vit() -> Built:
    cfg = _tf().ViTConfig(image_size=32, patch_size=4, hidden_size=32, num_hidden_layers=LAYERS, num_attention_heads=4,
                          intermediate_size=64, num_labels=4)
    return _classify("ViTForImageClassification", cfg, ("vit.layers",))  # vit.encoder.layer before transformers 5


def swin() -> Built:  # windowed attention; its stages are the blocks
    cfg = _tf().SwinConfig(image_size=32, patch_size=2, embed_dim=16, depths=[1, 1, 1], num_heads=[2, 4, 4],
                           window_size=4, num_labels=4)
    return _classify("SwinForImageClassification", cfg, ("swin.encoder.layers",))


def convnext() -> Built:  # its stages are the blocks
    cfg = _tf().ConvNextConfig(num_channels=3, patch_size=2, num_stages=4, hidden_sizes=[8, 16, 32, 32],
                               depths=[1, 1, 1, 1],
                               num_labels=4)
    return _classify("ConvNextForImageClassification", cfg, ("convnext.encoder.stages",))


# --- two towers -----------------------------------------------------------------------------------


def _towers(model_cls: str, cfg: Any, stacks: tuple[str, ...]) -> Built:
    batch = {"input_ids": _ids(), "pixel_values": _pixels(32), "return_loss": True}
    return _made(model_cls, cfg, batch, stacks)  # type: ignore[arg-type]


def clip() -> Built:
    tf = _tf()
    text = tf.CLIPTextConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, max_position_embeddings=32, **_IDS)
    vision = tf.CLIPVisionConfig(image_size=32, patch_size=4, hidden_size=32, intermediate_size=64,
                                 num_hidden_layers=2, num_attention_heads=4)
    cfg = tf.CLIPConfig(text_config=text.to_dict(), vision_config=vision.to_dict(), projection_dim=16)
    return _towers("CLIPModel", cfg, ("text_model.encoder.layers", "vision_model.encoder.layers"))


def siglip() -> Built:
    tf = _tf()
    text = tf.SiglipTextConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=4, max_position_embeddings=32, **_IDS)
    vision = tf.SiglipVisionConfig(image_size=32, patch_size=4, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4)
    cfg = tf.SiglipConfig(text_config=text.to_dict(), vision_config=vision.to_dict())
    return _towers("SiglipModel", cfg, ("text_model.encoder.layers", "vision_model.encoder.layers"))


# --- state space ----------------------------------------------------------------------------------


def mamba() -> Built:  # the slow (pure torch) path on CPU
    cfg = _tf().MambaConfig(vocab_size=VOCAB, hidden_size=32, state_size=8, num_hidden_layers=LAYERS,
                            expand=2, conv_kernel=4, **_IDS)
    ids = _ids(seq=SEQ // 4)  # 8 tokens: the reference scan loops over the sequence in Python
    return _made("MambaForCausalLM", cfg, {"input_ids": ids, "labels": ids}, ("backbone.layers",))


#: name -> builder, grouped by family.
ZOO: dict[str, Callable[[], Built]] = {
    "llama": llama, "mistral": mistral, "gemma": gemma, "qwen2": qwen2, "bloom": bloom, "falcon": falcon,
    "gpt_neox": gpt_neox, "phi": phi, "gpt2": gpt2, "gpt_bigcode": gpt_bigcode,
    "mixtral": mixtral, "qwen2_moe": qwen2_moe,
    "bert": bert, "deberta_v2": deberta_v2,
    "t5": t5, "bart": bart,
    "whisper": whisper, "wav2vec2": wav2vec2,
    "vit": vit, "swin": swin, "convnext": convnext,
    "clip": clip, "siglip": siglip,
    "mamba": mamba,
}  # fmt: skip
