"""Built-in models (pure torch), their named sizes (``remat.models.zoo``) and transformers
builders (``remat.models.hf``)."""

from remat.models.build import (
    Batch,
    LossFn,
    ModelConfig,
    build_model,
    classification_loss,
    lm_loss,
    loss_fn_for,
    make_batch,
    mlm_loss,
)
from remat.models.decoders import (
    GPT,
    Block,
    DecoderLayer,
    GPTConfig,
    Llama,
    LlamaConfig,
    rope_cos_sin,
)
from remat.models.encoders import (
    Bert,
    BertConfig,
    ConvNet,
    ConvNetConfig,
    Encoder,
    EncoderLayer,
    ResBlock,
    ViT,
    ViTConfig,
)
from remat.models.graphs import BiasLM, BiasLMConfig, UNet, UNetConfig

__all__ = [
    "GPT",
    "Batch",
    "Bert",
    "BertConfig",
    "BiasLM",
    "BiasLMConfig",
    "Block",
    "ConvNet",
    "ConvNetConfig",
    "DecoderLayer",
    "Encoder",
    "EncoderLayer",
    "GPTConfig",
    "Llama",
    "LlamaConfig",
    "LossFn",
    "ModelConfig",
    "ResBlock",
    "UNet",
    "UNetConfig",
    "ViT",
    "ViTConfig",
    "build_model",
    "classification_loss",
    "lm_loss",
    "loss_fn_for",
    "make_batch",
    "mlm_loss",
    "rope_cos_sin",
]
