"""``TrainConfig``: one training run, every field documented; ``validate`` checks one."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from remat.errors import InvalidValue
from remat.files import same_file
from remat.models import GPTConfig, LlamaConfig
from remat.units import check_budget

__all__ = ["PRECISIONS", "TrainConfig", "device_of", "validate"]

#: ``precision`` values: plain float32, or autocast to bfloat16 / float16 (float16 with a GradScaler).
PRECISIONS: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """One training run. Every field but ``out``, ``eval_every``, ``checkpoint_every`` and
    ``device`` must match when a run resumes from a checkpoint."""

    model: str | GPTConfig | LlamaConfig = "gpt-tiny"
    """A zoo name of a language model (``gpt-tiny``, ``llama-tiny``, ``gpt2``, ...), a
    ``GPTConfig`` / ``LlamaConfig``, or ``"package.module:factory"``: a zero-argument callable that
    returns a module mapping (batch, seq) int64 ids to (batch, seq, >= 256) logits (or a
    ``(model, batch, loss_fn)`` tuple, as the other commands take: the model is used). Built-in
    shapes get a vocabulary of 256 (bytes) and ``seq_len`` positions."""
    text: str | None = None
    """A text file to train on; None: Python's own ``pydoc_data.topics``."""
    budget: int | str | None = None
    """Peak memory of a training step: bytes, ``"2GiB"``, or ``"60%"`` of the plain step's peak
    with the whole global batch at once. None: no plan, no accumulation unless ``micro_batch``."""
    steps: int = 200
    """Optimizer steps."""
    global_batch: int = 16
    """Sequences per optimizer step."""
    micro_batch: int | None = None
    """Sequences per forward/backward; must divide ``global_batch``. None: chosen with the plan."""
    seq_len: int = 128
    """Tokens (bytes) per sequence."""
    lr: float = 1e-3
    """Peak learning rate (AdamW)."""
    warmup: int = 20
    """Steps of linear warm-up; then a cosine decay to 10% of ``lr`` at ``steps``."""
    weight_decay: float = 0.1
    """AdamW's decoupled weight decay."""
    precision: str = "fp32"
    """``fp32``, or autocast to ``bf16`` or ``fp16`` (with a GradScaler); weights stay float32."""
    clip: float | None = 1.0
    """Clip the gradients' global norm to this; None or 0: no clipping."""
    eval_every: int = 50
    """Evaluate on the held-out text every this many steps, and at the end; 0: at the end only."""
    checkpoint_every: int = 50
    """Write a checkpoint every this many steps, and at the end; 0: at the end only."""
    out: str | None = None
    """Folder for ``checkpoint.pt``, ``log.json`` and ``loss.png``; None: write nothing."""
    seed: int = 0
    """Seed of the weights, dropout and the data order."""
    device: str | None = None
    """``cpu``, ``cuda``, ``cuda:1``...; None: CUDA when there is one."""


def validate(config: TrainConfig) -> None:
    """Raise ``ValueError`` naming the first field of ``config`` that no run can use."""
    def positive_int(name: str, value: Any, low: int = 1) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise InvalidValue(f"{name} must be an int >= {low}, got {value!r}")

    positive_int("steps", config.steps)
    positive_int("global_batch", config.global_batch)
    positive_int("seq_len", config.seq_len, 2)
    positive_int("warmup", config.warmup, 0)
    positive_int("eval_every", config.eval_every, 0)
    positive_int("checkpoint_every", config.checkpoint_every, 0)
    if config.micro_batch is not None:
        positive_int("micro_batch", config.micro_batch)
        if config.global_batch % config.micro_batch:
            raise InvalidValue(f"micro_batch={config.micro_batch} must divide "
                             f"global_batch={config.global_batch}")
    if config.precision not in PRECISIONS:
        raise InvalidValue(f"unknown precision {config.precision!r}; expected one of {list(PRECISIONS)}")
    if not (math.isfinite(config.lr) and config.lr > 0):
        raise InvalidValue(f"lr must be a finite number > 0, got {config.lr!r}")
    if config.clip is not None and not (math.isfinite(config.clip) and config.clip >= 0):
        raise InvalidValue(f"clip must be a finite number >= 0 (0: no clipping), got {config.clip!r}")
    if config.budget is not None:
        check_budget(config.budget)
    device_of(config.device)
    if config.text is not None and config.out is not None:
        for name in ("checkpoint.pt", "log.json", "loss.png"):
            if same_file(config.text, Path(config.out) / name):
                raise InvalidValue(f"the text {config.text} is the run's own {name}, which the run "
                                   "rewrites; train on another file, or choose another out folder")


def device_of(name: str | None) -> torch.device:
    """The device of ``TrainConfig.device``, checked: one torch knows, and one this machine has."""
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        raise InvalidValue(f"unknown device {name!r}; expected cpu, cuda or cuda:N") from None
    if device.type not in ("cpu", "cuda"):
        raise InvalidValue(f"remat train runs on cpu or cuda[:N], not {name!r}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise InvalidValue(f"device {name!r}: CUDA is not available here (torch "
                               f"{torch.__version__}); train on the CPU with device='cpu'")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise InvalidValue(f"device {name!r}: this machine has {torch.cuda.device_count()} "
                               "CUDA device(s)")
    return device
