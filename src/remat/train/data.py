"""Text for ``remat train``: byte-level tokens from a file or the standard library, nothing
downloaded; and the byte-level model and loss that read them.

Tokens are the text's UTF-8 bytes (a vocabulary of 256). The last 10% of the bytes are held out
for evaluation. ``Sampler`` draws training windows at random offsets from its own generator, so its
position in the data is a small state (the generator's state and a count) that a checkpoint can
carry; ``eval_windows`` are fixed, evenly spaced windows of the held-out part. A model reads a
``(batch, seq)`` int64 tensor of ids and gives ``(batch, seq, >= 256)`` logits; ``text_loss`` is the
next-byte cross-entropy.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from remat.errors import InvalidType, InvalidValue, MissingFile, NotAFile
from remat.models import GPTConfig, LlamaConfig, build_model, lm_loss

__all__ = [
    "VOCAB_SIZE",
    "Sampler",
    "TextData",
    "build_text_model",
    "eval_windows",
    "load_text",
    "text_loss",
]

#: Byte-level tokens: every id is one byte of the UTF-8 text.
VOCAB_SIZE = 256
_HELD_OUT = 0.1
_STATE_VERSION = 1


@dataclass(frozen=True, kw_only=True)
class TextData:
    """A text as byte tokens, split into a training part and a held-out part."""

    source: str
    """Where the text came from: a file path, or ``"pydoc_data.topics"``."""
    sha256: str
    """Hash of the text's bytes: a checkpoint is refused on other text."""
    train: torch.Tensor
    """The first 90% of the bytes, uint8 (ids 0..255)."""
    held_out: torch.Tensor
    """The last 10% of the bytes, uint8, for evaluation."""


def load_text(path: str | Path | None = None) -> TextData:
    """The text of ``path`` (UTF-8 or any bytes), or by default the topic help texts that ship with
    Python (``pydoc_data.topics``, ~470 kB of English and code)."""
    if path is None:
        from pydoc_data.topics import topics

        raw = "\n\n".join(topics[k] for k in sorted(topics)).encode("utf-8")
        source = "pydoc_data.topics"
    else:
        p = Path(path)
        try:
            raw = p.read_bytes()
        except FileNotFoundError:
            raise MissingFile(f"no such text file: {p}") from None
        except IsADirectoryError:
            raise NotAFile(f"{p} is a folder; pass one text file") from None
        source = str(p)
    tokens = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    split = int(len(tokens) * (1 - _HELD_OUT))
    return TextData(
        source=source,
        sha256=hashlib.sha256(raw).hexdigest(),
        train=tokens[:split].clone(),
        held_out=tokens[split:].clone(),
    )


def _check_length(tokens: torch.Tensor, seq_len: int, part: str, source: str) -> None:
    if len(tokens) < seq_len + 1:
        raise InvalidValue(
            f"the {part} part of {source} has {len(tokens)} bytes, fewer than one sequence of "
            f"seq_len={seq_len} (+1); use a longer text or a shorter --seq"
        )


class Sampler:
    """Random training windows: each call draws ``batch_size`` offsets from its own generator.

    ``state_dict()`` / ``load_state_dict()`` hold its position (the generator's state and the
    number of batches drawn), so a resumed run draws the very batches the first run would have.
    """

    def __init__(self, data: TextData, *, seq_len: int, seed: int) -> None:
        _check_length(data.train, seq_len, "training", data.source)
        self.tokens = data.train
        self.seq_len = seq_len
        self.generator = torch.Generator().manual_seed(seed)
        self.drawn = 0
        """Batches drawn so far."""

    def next(self, batch_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """``(batch_size, seq_len)`` int64 token ids on ``device``."""
        high = len(self.tokens) - self.seq_len + 1
        starts = torch.randint(high, (batch_size,), generator=self.generator)
        rows = starts[:, None] + torch.arange(self.seq_len)[None, :]
        self.drawn += 1
        return self.tokens[rows].long().to(device)

    def state_dict(self) -> dict[str, Any]:
        return {"version": _STATE_VERSION, "generator": self.generator.get_state(), "drawn": self.drawn}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("version") != _STATE_VERSION:
            raise InvalidValue(f"sampler state of version {state.get('version')!r}, expected {_STATE_VERSION}")
        self.generator.set_state(state["generator"])
        self.drawn = int(state["drawn"])


def eval_windows(data: TextData, *, seq_len: int, max_windows: int = 32) -> torch.Tensor:
    """Up to ``max_windows`` evenly spaced, non-overlapping windows of the held-out part, as a
    ``(windows, seq_len)`` int64 tensor: the same windows at every evaluation."""
    _check_length(data.held_out, seq_len, "held-out", data.source)
    count = min(max_windows, len(data.held_out) // seq_len)
    stride = len(data.held_out) // count
    starts = torch.arange(count) * stride
    rows = starts[:, None] + torch.arange(seq_len)[None, :]
    return data.held_out[rows].long()


# --- the model and the loss that read it ------------------------------------------------------


def text_loss(logits: Any, batch: Any) -> torch.Tensor:
    """``lm_loss`` with a check that the model gives one logit per byte value at each position."""
    ids = batch[0]
    if not isinstance(logits, torch.Tensor) or logits.dim() != 3 or logits.shape[:2] != ids.shape \
            or logits.shape[2] < VOCAB_SIZE:
        got = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise InvalidValue(
            f"remat train expects the model to map ids (batch, seq) = {tuple(ids.shape)} to logits "
            f"(batch, seq, >= {VOCAB_SIZE}), got {got}"
        )
    return lm_loss(logits, batch)


def build_text_model(spec: str | GPTConfig | LlamaConfig, *, seq_len: int,
                     device: torch.device | str = "cpu") -> nn.Module:
    """The model of ``TrainConfig.model`` on ``device`` (see there), from the current RNG state."""
    if isinstance(spec, str) and ":" in spec:
        return _from_factory(spec).to(device)
    if isinstance(spec, str):
        from remat.models import zoo

        config = zoo.spec(spec).config
    else:
        config = spec
    if isinstance(config, GPTConfig):
        config = dataclasses.replace(config, vocab_size=VOCAB_SIZE, block_size=seq_len)
    elif isinstance(config, LlamaConfig):
        config = dataclasses.replace(config, vocab_size=VOCAB_SIZE, max_seq=seq_len)
    else:
        raise InvalidValue(
            f"remat train trains language models on text; {spec!r} is a {type(config).__name__} "
            "model. Use gpt-tiny, llama-tiny, gpt2, llama-1b, ... or a package.module:factory"
        )
    return build_model(config, device=device)


def _from_factory(spec: str) -> nn.Module:
    module_name, _, attr = spec.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (Exception, SystemExit) as e:  # a user's module may fail in any way; say which and why
        raise InvalidValue(f"cannot load the model factory {spec!r} ({type(e).__name__}: {e}); "
                         "expected 'package.module:factory' naming a zero-argument callable") from None
    try:
        model = factory()
    except (Exception, SystemExit) as e:  # SystemExit too: it would end a command silently
        raise InvalidValue(f"the factory {spec} raised {type(e).__name__}: {e}") from e
    # The other commands' factories return (model, batch, loss_fn): the text brings its own batch.
    if isinstance(model, tuple | list) and model:
        model = model[0]
    if not isinstance(model, nn.Module):
        raise InvalidType(f"the factory {spec!r} returned a {type(model).__name__}, not an nn.Module "
                        "(or a (model, batch, loss_fn) tuple)")
    return model
