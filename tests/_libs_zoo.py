"""Tiny models from libraries this project's code was not written against (random init).

``LIBS[name]()`` gives ``(model, batch, loss_fn)``: the library's own classes, built with tiny
configs so that a CPU step takes milliseconds; ``batch`` is what ``model(*batch)`` (a tuple) or
``model(**batch)`` (a dict) takes, ``loss_fn(output, batch)`` a scalar. Each library is installed
with ``--no-deps`` beside the pinned torch (``make install``); a model whose library does not
import is skipped by the tests, with the reason.

The shapes they bring: diffusers' UNets keep their down path as a list of different classes (or,
where a stage class repeats, a stack of stages that keep their layers in lists of their own) and
their middle block as a lone attribute; its Flux transformer's single blocks return (context,
hidden), and the last one's context is dropped (its first output gets no gradient); vit-pytorch and x-transformers keep each layer as a
``ModuleList`` of ``ModuleList``s iterated by their own loop (``for attn, ff in self.layers``);
litgpt has its own layer loop with rotary tables passed to every block; peft freezes the base
model, so the first block's input does not require grad; performer-pytorch computes its random
features in a branch it detaches, and counts its calls in a buffer; perceiver-pytorch's
``weight_tie_layers`` calls one module for every layer after the first (no block: it runs more
than once per step); x-unet's UNet keeps each down stage's output in a list for the up path, and
that output is the first input of the stage's downsampler too, which saves nothing of it;
x-transformers' attention with a mask calls einx, which wraps every error in its own (a recompute's
early stop too); transformers' DETR caches its position embedding from one step to the next;
MONAI's UNet nests its up path in skip connections, all of it after the down path's last block;
fair-esm's ESM-2 reads its batch's values (token dropout counts the masked tokens), returns each
layer's attention weights for the loop to drop, and trains on ``logits[mask]``.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

Built = tuple[nn.Module, Any, Callable[[Any, Any], torch.Tensor]]
BATCH = 4


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(1)


def _sample_loss(output: Any, batch: Any) -> torch.Tensor:
    return output.sample.float().square().mean()


def diffusers_unet() -> Built:
    from diffusers import UNet2DModel

    torch.manual_seed(0)
    model = UNet2DModel(sample_size=16, in_channels=3, out_channels=3, layers_per_block=1,
                        block_out_channels=(32, 64), norm_num_groups=8,
                        down_block_types=("DownBlock2D", "AttnDownBlock2D"),
                        up_block_types=("AttnUpBlock2D", "UpBlock2D"))
    x = torch.randn(BATCH, 3, 16, 16, generator=_gen())
    return model.train(), (x, torch.tensor([10] * BATCH)), _sample_loss


def diffusers_cond_unet() -> Built:
    from diffusers import UNet2DConditionModel

    torch.manual_seed(0)
    model = UNet2DConditionModel(sample_size=16, in_channels=4, out_channels=4, layers_per_block=1,
                                 block_out_channels=(32, 64), norm_num_groups=8, cross_attention_dim=32,
                                 attention_head_dim=8,
                                 down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                                 up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"))
    x = torch.randn(BATCH, 4, 16, 16, generator=_gen())
    text = torch.randn(BATCH, 8, 32, generator=_gen())
    return model.train(), (x, torch.tensor([10] * BATCH), text), _sample_loss


def diffusers_cond_unet_stages() -> Built:
    """Stages of two layers each, where a stage class repeats (NOTE [ Blocks by what runs ], rule 7)."""
    from diffusers import UNet2DConditionModel

    torch.manual_seed(0)
    model = UNet2DConditionModel(sample_size=16, in_channels=4, out_channels=4, layers_per_block=2,
                                 block_out_channels=(32, 64, 64), norm_num_groups=8, cross_attention_dim=32,
                                 attention_head_dim=8,
                                 down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
                                 up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"))
    x = torch.randn(BATCH, 4, 16, 16, generator=_gen())
    text = torch.randn(BATCH, 8, 32, generator=_gen())
    return model.train(), (x, torch.tensor([10] * BATCH), text), _sample_loss


def diffusers_svd_unet() -> Built:
    """diffusers' SVD UNet: spatio-temporal resnets and attentions, each a spatial and a temporal
    half and a learned mix of the two, whole blocks (NOTE [ Blocks by what runs ], rule 4)."""
    from diffusers import UNetSpatioTemporalConditionModel

    torch.manual_seed(0)
    model = UNetSpatioTemporalConditionModel(
        sample_size=16, in_channels=8, out_channels=4, block_out_channels=(32, 64), layers_per_block=1,
        down_block_types=("CrossAttnDownBlockSpatioTemporal", "DownBlockSpatioTemporal"),
        up_block_types=("UpBlockSpatioTemporal", "CrossAttnUpBlockSpatioTemporal"), addition_time_embed_dim=8,
        projection_class_embeddings_input_dim=24, cross_attention_dim=32, num_attention_heads=(2, 4), num_frames=4)
    g = _gen()
    batch = {"sample": torch.randn(1, 4, 8, 16, 16, generator=g), "timestep": torch.tensor([10]),
             "encoder_hidden_states": torch.randn(1, 1, 32, generator=g), "added_time_ids": torch.randn(1, 3, generator=g)}
    return model.train(), batch, _sample_loss


def diffusers_vqmodel() -> Built:
    """diffusers' VQModel trained on its reconstruction alone: the quantizer's commitment loss, left
    out of the loss, dies with the model's output, and with it all the quantizer saves (NOTE [ Blocks
    by what runs ], rule 1)."""
    from diffusers import VQModel

    torch.manual_seed(0)
    model = VQModel(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                    up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(16, 32), layers_per_block=1,
                    latent_channels=3, num_vq_embeddings=32, norm_num_groups=8, sample_size=32)
    return model.train(), (torch.randn(BATCH, 3, 32, 32, generator=_gen()),), _sample_loss


def diffusers_flux() -> Built:
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    model = FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=2, num_single_layers=3,
                                   attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                   pooled_projection_dim=24, guidance_embeds=False, axes_dims_rope=(4, 6, 6))
    tokens, text = 64, 8
    image_ids = torch.stack([torch.zeros(tokens), torch.arange(tokens) // 8, torch.arange(tokens) % 8], dim=1)
    batch = {"hidden_states": torch.randn(BATCH, tokens, 16, generator=_gen()),
             "encoder_hidden_states": torch.randn(BATCH, text, 32, generator=_gen()),
             "pooled_projections": torch.randn(BATCH, 24, generator=_gen()),
             "timestep": torch.full((BATCH,), 0.5), "img_ids": image_ids, "txt_ids": torch.zeros(text, 3)}
    return model.train(), batch, _sample_loss


def _file_module(package: str, name: str) -> ModuleType:
    """``package.name`` loaded from its file, without running the package's ``__init__`` (which
    for vit-pytorch imports torchvision, which does not import beside this torch build)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"{package} is not installed")
    path = f"{next(iter(spec.submodule_search_locations))}/{name}.py"
    module_spec = importlib.util.spec_from_file_location(f"_zoo_{package}_{name}", path)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_spec.name] = module
    module_spec.loader.exec_module(module)
    return module


def x_unet() -> Built:
    from x_unet import XUnet

    torch.manual_seed(0)
    model = XUnet(dim=16, channels=3, dim_mults=(1, 2, 4), num_blocks_per_stage=(1, 1, 1), nested_unet_depths=(0, 0, 0),
                  num_self_attn_per_stage=(0, 0, 1), attn_heads=2, attn_dim_head=8)
    return model.train(), (torch.randn(2, 3, 32, 32, generator=_gen()),), lambda output, batch: output.square().mean()


def _class_loss(output: Any, batch: Any) -> torch.Tensor:
    return F.cross_entropy(output, torch.arange(output.shape[0]) % output.shape[-1])


def vit_pytorch_vit() -> Built:
    ViT = _file_module("vit_pytorch", "vit").ViT
    torch.manual_seed(0)
    model = ViT(image_size=32, patch_size=4, num_classes=10, dim=64, depth=8, heads=4, mlp_dim=128)
    return model.train(), (torch.randn(BATCH, 3, 32, 32, generator=_gen()),), _class_loss


def _lm_loss(output: Any, batch: Any) -> torch.Tensor:
    logits = output if isinstance(output, torch.Tensor) else output.logits
    ids = batch[0]
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1))


def _ids(vocab: int = 256, seq: int = 128) -> torch.Tensor:
    return torch.randint(0, vocab, (BATCH, seq), generator=_gen())


def x_transformers_gpt() -> Built:
    from x_transformers import Decoder, TransformerWrapper

    torch.manual_seed(0)
    model = TransformerWrapper(num_tokens=256, max_seq_len=128,
                               attn_layers=Decoder(dim=64, depth=8, heads=4, rotary_pos_emb=True))
    return model.train(), (_ids(),), _lm_loss


def x_transformers_masked() -> Built:
    from x_transformers import ContinuousTransformerWrapper, Encoder

    torch.manual_seed(0)
    model = ContinuousTransformerWrapper(dim_in=16, dim_out=16, max_seq_len=64,
                                         attn_layers=Encoder(dim=64, depth=6, heads=4))
    mask = torch.ones(BATCH, 64, dtype=torch.bool)
    mask[:, 48:] = False
    batch = {"x": torch.randn(BATCH, 64, 16, generator=_gen()), "mask": mask}
    return model.train(), batch, lambda output, batch: output.square().mean()


def litgpt_gpt() -> Built:
    from litgpt.config import Config
    from litgpt.model import GPT

    torch.manual_seed(0)
    config = Config(block_size=128, vocab_size=256, padded_vocab_size=256, n_layer=8, n_head=4, n_embd=64,
                    rotary_percentage=1.0, parallel_residual=False, bias=False, norm_class_name="RMSNorm",
                    mlp_class_name="LLaMAMLP", intermediate_size=128)
    return GPT(config).train(), (_ids(),), _lm_loss


def peft_lora_llama() -> Built:
    import peft
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=8,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    base = transformers.LlamaForCausalLM(cfg)
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    return model.train(), {"input_ids": _ids()}, lambda output, batch: _lm_loss(output, (batch["input_ids"],))


def performer_lm() -> Built:
    from performer_pytorch import PerformerLM

    torch.manual_seed(0)
    model = PerformerLM(num_tokens=256, max_seq_len=128, dim=64, depth=4, heads=4, causal=False,
                        feature_redraw_interval=None)
    return model.train(), (_ids(),), _lm_loss


def perceiver_tied() -> Built:
    from perceiver_pytorch import Perceiver

    torch.manual_seed(0)
    model = Perceiver(input_channels=3, input_axis=2, num_freq_bands=4, max_freq=10.0, depth=4, num_latents=32,
                      latent_dim=64, latent_heads=2, cross_heads=1, num_classes=10, weight_tie_layers=True)
    return model.train(), (torch.randn(BATCH, 16, 16, 3, generator=_gen()),), _class_loss


def transformers_detr() -> Built:
    """DETR without timm: a ResNet backbone, and a position embedding transformers caches across
    steps (``lru_cache``; NOTE [ A side input the model keeps past the step ] in remat.measure.sides)."""
    import transformers

    torch.manual_seed(0)
    backbone = transformers.ResNetConfig(num_channels=3, embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1],
                                         out_features=["stage2"])
    cfg = transformers.DetrConfig(use_timm_backbone=False, backbone_config=backbone, use_pretrained_backbone=False,
                                  d_model=32, encoder_layers=4, decoder_layers=4, encoder_attention_heads=4,
                                  decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, num_queries=16)
    batch = {"pixel_values": torch.randn(BATCH, 3, 64, 64, generator=_gen())}
    return transformers.DetrModel(cfg).train(), batch, lambda out, b: out.last_hidden_state.square().mean()


def transformers_pvt() -> Built:
    """PVT: stages as lists of layers beside a list of patch embeddings, the first fed the pixels,
    and no checkpointing of transformers' own."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.PvtConfig(image_size=32, num_encoder_blocks=2, depths=[2, 2], sequence_reduction_ratios=[2, 1],
                                 hidden_sizes=[16, 32], patch_sizes=[4, 2], strides=[4, 2], num_attention_heads=[1, 2],
                                 mlp_ratios=[2, 2], num_labels=10)
    batch = {"pixel_values": torch.randn(BATCH, 3, 32, 32, generator=_gen()),
             "labels": torch.randint(0, 10, (BATCH,), generator=_gen())}
    return transformers.PvtForImageClassification(cfg).train(), batch, lambda out, b: out.loss


def transformers_segformer() -> Built:
    """SegFormer: stages of a patch embedding (the first fed the pixels), a list of layers and a
    bare closing norm; transformers checkpoints the layers alone (NOTE [ Blocks by what runs ],
    rule 7)."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.SegformerConfig(num_encoder_blocks=2, depths=[2, 2], sr_ratios=[2, 1], hidden_sizes=[16, 32],
                                       num_attention_heads=[1, 2], patch_sizes=[7, 3], strides=[4, 2],
                                       decoder_hidden_size=32, num_labels=4)
    batch = {"pixel_values": torch.randn(BATCH, 3, 32, 32, generator=_gen()),
             "labels": torch.randint(0, 4, (BATCH, 32, 32), generator=_gen())}
    return transformers.SegformerForSemanticSegmentation(cfg).train(), batch, lambda out, b: out.loss


def monai_unet() -> Built:
    """MONAI's UNet: a down path of residual units that stacks give, and an up path nested in skip
    connections that runs after the last of them (NOTE [ Blocks by what runs ], rule 3)."""
    from monai.networks.nets import UNet

    torch.manual_seed(0)
    model = UNet(spatial_dims=2, in_channels=1, out_channels=2, channels=(8, 16, 32, 64), strides=(2, 2, 2),
                 num_res_units=2)
    return model.train(), (torch.randn(BATCH, 1, 64, 64, generator=_gen()),), lambda out, b: out.square().mean()


def monai_dynunet() -> Built:
    """MONAI's DynUNet: a stem fed the image (``input_block``), residual units of single convolutions
    with norms between, and every module held again under a recursive ``skip_layers`` that the
    forward runs (NOTE [ Blocks by what runs ], rules 3-5)."""
    from monai.networks.nets import DynUNet

    torch.manual_seed(0)
    model = DynUNet(spatial_dims=2, in_channels=1, out_channels=2, kernel_size=[3, 3, 3, 3], strides=[1, 2, 2, 2],
                    upsample_kernel_size=[2, 2, 2], filters=[8, 16, 32, 64], res_block=True)
    return model.train(), (torch.randn(BATCH, 1, 64, 64, generator=_gen()),), lambda out, b: out.square().mean()


def monai_unetr() -> Built:
    """MONAI's UNETR: encoders branch off a ViT's hidden states, and the model's code keeps their
    outputs until decoders take them besides their hidden input, each saved by the encoder that
    made it where that ends in an in-place activation (NOTE [ A skip from a block's output ])."""
    from monai.networks.nets import UNETR

    torch.manual_seed(0)
    model = UNETR(in_channels=1, out_channels=2, img_size=(64, 64), feature_size=8, hidden_size=64, mlp_dim=128,
                  num_heads=4, spatial_dims=2)
    return model.train(), (torch.randn(BATCH, 1, 64, 64, generator=_gen()),), lambda out, b: out.square().mean()


def monai_vnet() -> Built:
    """MONAI's VNet: stages of a strided convolution and its norm before a ``Sequential`` of
    convolution layers, whose bare layers are blocks too (NOTE [ Blocks by what runs ], rule 7)."""
    from monai.networks.nets import VNet

    torch.manual_seed(0)
    model = VNet(spatial_dims=2, in_channels=1, out_channels=2)
    return model.train(), (torch.randn(2, 1, 64, 64, generator=_gen()),), lambda out, b: out.square().mean()


def _deep_loss(output: Any, batch: Any) -> torch.Tensor:
    """Deep supervision: every output of the decoder, each half the weight of the one before."""
    outputs = output if isinstance(output, (list, tuple)) else [output]
    return sum((o.float().square().mean() * 0.5**i for i, o in enumerate(outputs)), torch.zeros(()))


def monai_segresnet_ds() -> Built:
    """MONAI's SegResNetDS with deep supervision: its decoder adds each skip into the upsampled
    output in place (``x += skip``) before the next block takes it, which ends segments there (NOTE
    [ A first input made between blocks ]); a segment across it gave the floor plan wrong gradients."""
    from monai.networks.nets import SegResNetDS

    torch.manual_seed(0)
    model = SegResNetDS(spatial_dims=2, init_filters=8, in_channels=1, out_channels=3, dsdepth=3)
    return model.train(), (torch.randn(2, 1, 64, 64, generator=_gen()),), _deep_loss


def monai_basicunet() -> Built:
    """MONAI's BasicUNet: stages that pool before their two convolutions, or concatenate the skip
    after their upsampler, in their own code, which split would keep what that code saves and makes
    at every budget: its stages are blocks whole (NOTE [ Blocks by what runs ], rule 9)."""
    from monai.networks.nets import BasicUNet

    torch.manual_seed(0)
    model = BasicUNet(spatial_dims=2, in_channels=1, out_channels=3, features=(8, 16, 32, 64, 128, 8), dropout=0.1)
    return model.train(), (torch.randn(BATCH, 1, 64, 64, generator=_gen()),), lambda out, b: out.square().mean()


def fair_esm2() -> Built:
    """fair-esm's ESM-2, trained as a masked language model: its forward counts the masked tokens of
    its batch (token dropout), its layers return their head-averaged attention weights besides their
    output (a handover its kept forward does not save), and the loss takes ``logits[mask]``."""
    from esm.model.esm2 import ESM2

    torch.manual_seed(0)
    model = ESM2(num_layers=4, embed_dim=64, attention_heads=4, alphabet="ESM-1b", token_dropout=True)
    gen = _gen()
    target = torch.randint(4, 24, (BATCH, 128), generator=gen)
    target[:, 0], target[:, -1] = model.cls_idx, model.eos_idx
    mask = torch.rand(BATCH, 128, generator=gen) < 0.15
    mask[:, 0] = mask[:, -1] = False

    def loss(output: Any, batch: Any) -> torch.Tensor:
        return F.cross_entropy(output["logits"][mask], target[mask])

    return model.train(), (target.masked_fill(mask, model.mask_idx),), loss


LIBS: dict[str, Callable[[], Built]] = {
    "diffusers-unet": diffusers_unet,
    "diffusers-cond-unet": diffusers_cond_unet,
    "diffusers-cond-unet-stages": diffusers_cond_unet_stages,
    "diffusers-svd-unet": diffusers_svd_unet,
    "diffusers-vqmodel": diffusers_vqmodel,
    "diffusers-flux": diffusers_flux,
    "x-unet": x_unet,
    "vit-pytorch-vit": vit_pytorch_vit,
    "x-transformers-gpt": x_transformers_gpt,
    "x-transformers-masked": x_transformers_masked,
    "litgpt-gpt": litgpt_gpt,
    "peft-lora-llama": peft_lora_llama,
    "performer-lm": performer_lm,
    "perceiver-tied": perceiver_tied,
    "transformers-detr": transformers_detr,
    "transformers-pvt": transformers_pvt,
    "transformers-segformer": transformers_segformer,
    "monai-unet": monai_unet,
    "monai-dynunet": monai_dynunet,
    "monai-unetr": monai_unetr,
    "monai-vnet": monai_vnet,
    "monai-segresnet-ds": monai_segresnet_ds,
    "monai-basicunet": monai_basicunet,
    "fair-esm2": fair_esm2,
}

# Modules a user might checkpoint by hand (torch's checkpoint on each): remat's floor is at or below
# their peak too. MONAI's UNet: the down path's units and the up modules after it; DynUNet: its
# stem, units and up modules; UNETR: its ViT's layers, its encoders and decoders, whole; VNet: its
# stages, whole; BasicUNet: its stages, whole; diffusers' SVD UNet and VQModel: their resnets and attentions (the granularity
# diffusers' own checkpointing takes).
_MONAI_DOWN = ["model.0", "model.1.submodule.0", "model.1.submodule.1.submodule.0", "model.1.submodule.1.submodule.1.submodule"]
SENSIBLE: dict[str, list[str]] = {
    "monai-unet": [*_MONAI_DOWN, "model.1.submodule.1.submodule.2", "model.1.submodule.2", "model.2"],  # whole units
    "diffusers-svd-unet": [f"{stage}.{part}" for stage, part in [
        ("down_blocks.0", "resnets.0"), ("down_blocks.0", "attentions.0"), ("down_blocks.1", "resnets.0"),
        ("mid_block", "resnets.0"), ("mid_block", "attentions.0"), ("mid_block", "resnets.1"),
        *((f"up_blocks.{u}", f"{kind}.{k}") for u, kinds in ((0, ("resnets",)), (1, ("resnets", "attentions")))
          for kind in kinds for k in range(2))]],
    "diffusers-vqmodel": [*(f"encoder.down_blocks.{i}.resnets.0" for i in range(2)),
                          *(f"{part}.mid_block.{kind}" for part in ("encoder", "decoder")
                            for kind in ("resnets.0", "attentions.0", "resnets.1")),
                          *(f"decoder.up_blocks.{i}.resnets.{k}" for i in range(2) for k in range(2))],
    "monai-unetr": [*(f"vit.blocks.{i}" for i in range(12)), *(f"encoder{i}" for i in range(1, 5)),
                    *(f"decoder{i}" for i in range(2, 6))],
    "monai-basicunet": ["conv_0", *(f"down_{i}" for i in range(1, 5)), *(f"upcat_{i}" for i in range(1, 5))],
    "monai-vnet": ["in_tr", "down_tr32", "down_tr64", "down_tr128", "down_tr256", "up_tr256", "up_tr128", "up_tr64"],
    "fair-esm2": [f"layers.{i}" for i in range(4)],
    "monai-dynunet": ["input_block", "downsamples.0", "downsamples.1", "bottleneck", "upsamples.0", "upsamples.1",
                      "upsamples.2"],
}

# What profiling a model warns of (a match for pytest.warns): the tests expect it.
WARNS: dict[str, str] = {"perceiver-tied": "ran more than once in one training step",
                         "monai-segresnet-ds": "changes in place the output of an op",
                         "fair-esm2": "changes in place the output of an op"}  # q *= self.scaling
