"""What ``remat.train`` keeps and writes: its log records, the checkpoint file, the JSON log, the plot.

A checkpoint is one ``torch.save`` file written atomically (NOTE [ Atomic outputs ] in
``remat.files``), so a crash while writing leaves the previous checkpoint whole. It is read with
``weights_only=True`` (tensors, dicts, lists and numbers only: loading runs no code). A file that
cannot be read, that fails its checksum, or that belongs to another run, is refused and never
overwritten.

# NOTE [ Checkpoint checksums ]
torch's zip format checks no data: one flipped bit in a weight loads silently. So the state is
stored with ``sha256``, a hash of every value in it (each tensor's dtype, shape and raw bytes;
every number, string and key, in order), recomputed and compared on every read before anything
uses the state.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import random
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from remat.errors import CheckpointError, MissingDependency
from remat.files import atomic_write, clear_dead_writers
from remat.records import Plan
from remat.train.accumulation import Candidate

if TYPE_CHECKING:
    from remat.train.config import TrainConfig

__all__ = [
    "OUTPUTS",
    "CheckpointError",
    "EvalLog",
    "StepLog",
    "TrainResult",
    "clear_debris",
    "config_dict",
    "load_checkpoint",
    "plot_losses",
    "read_config",
    "rng_state",
    "save_checkpoint",
    "set_rng_state",
    "write_outputs",
]

log = logging.getLogger(__name__)

_FORMAT = "remat-train-checkpoint"
_VERSION = 2  # 2: with "sha256" (NOTE [ Checkpoint checksums ])
LOG_SCHEMA = 1
#: Settings that may change when a run resumes; every other one must match the checkpoint's.
#: (The text is compared by its hash, not by its path.)
_MAY_CHANGE = ("out", "eval_every", "checkpoint_every", "device", "text")
#: The files a run writes into its folder (``out``).
OUTPUTS = ("checkpoint.pt", "log.json", "loss.png")
_KEYS = ("config", "fingerprint", "step", "model", "optimizer", "scheduler", "scaler", "sampler",
         "rng", "plan", "micro_batch", "history")


@dataclass(frozen=True, kw_only=True)
class StepLog:
    """One optimizer step."""

    step: int
    """Optimizer steps done, counting this one (1 for the first)."""
    loss: float
    """Mean training loss over the global batch, nats per byte."""
    lr: float
    """Learning rate the step used."""
    tokens_per_s: float
    """Tokens (bytes) trained per second of this step's wall-clock time."""
    grad_norm: float | None = None
    """Global gradient norm before clipping (None without clipping)."""
    peak_bytes: int | None = None
    """Peak memory measured on this step (every step on CUDA; on the CPU one step per process, the
    first with optimizer state, as the allocator trace slows it down); None when not measured."""


@dataclass(frozen=True, kw_only=True)
class EvalLog:
    """One evaluation on the held-out text."""

    step: int
    """Optimizer steps done when it ran."""
    loss: float
    """Mean loss on the held-out windows, nats per byte."""


@dataclass(frozen=True, kw_only=True)
class TrainResult:
    """What a run did (resumed runs include the steps before the interruption)."""

    config: TrainConfig
    """The run's settings."""
    steps: list[StepLog]
    """Every optimizer step."""
    evals: list[EvalLog]
    """Every evaluation."""
    plan: Plan | None
    """The checkpointing plan applied; None without a budget."""
    micro_batch: int
    """Sequences per forward/backward."""
    accumulation_steps: int
    """Micro-batches per optimizer step."""
    candidates: list[Candidate]
    """The micro-batch sizes the planner considered."""
    budget_bytes: int | None
    """The budget in bytes (a ``"60%"`` budget resolved); None without one."""
    measured_peak_bytes: int | None
    """The highest measured step peak (see ``StepLog.peak_bytes``)."""
    completed_steps: int
    """Optimizer steps done."""
    checkpoint: Path | None
    """The checkpoint file written, if any."""

    @property
    def predicted_peak_bytes(self) -> int | None:
        """The chosen candidate's predicted peak (None without a budget)."""
        return next((c.predicted_peak_bytes for c in self.candidates if c.chosen), None)


def config_dict(config: TrainConfig, text_sha256: str) -> dict[str, Any]:
    """The config as plain JSON data, with the text's hash: what a checkpoint must match."""
    data = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    model = data["model"]
    if not isinstance(model, str):
        data["model"] = {"class": type(model).__name__, **dataclasses.asdict(model)}
    data["text_sha256"] = text_sha256
    normalised: dict[str, Any] = json.loads(json.dumps(data))
    return normalised


def save_checkpoint(path: Path, state: dict[str, Any]) -> None:
    """Write ``state`` (the keys of ``_KEYS``) to ``path`` atomically."""
    missing = [k for k in _KEYS if k not in state]
    assert not missing, missing
    body = {k: state[k] for k in _KEYS}
    record = {"format": _FORMAT, "version": _VERSION, "sha256": checksum(body), **body}
    atomic_write(path, lambda f: torch.save(record, f))


def clear_debris(out: Path) -> None:
    """Remove what writers of this run's files left in ``out`` when they were killed mid-write
    (NOTE [ Temporary files name their writer ] in ``remat.files``); live writers' files and every
    other file stay."""
    for name in OUTPUTS:
        for tmp in clear_dead_writers(out / name):
            log.info("removed %s, left by a writer of %s that was killed while writing it", tmp, name)


def checksum(state: Any) -> str:
    """The sha256 of ``state`` (NOTE [ Checkpoint checksums ]); lists and tuples hash alike, as
    ``torch.load`` may return one for the other."""
    digest = hashlib.sha256()
    _hash(state, digest)
    return digest.hexdigest()


def _hash(obj: Any, digest: Any) -> None:
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        digest.update(f"T{t.dtype}{tuple(t.shape)}:".encode())
        if t.numel():
            digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(obj, dict):
        digest.update(f"D{len(obj)}:".encode())
        for key, value in obj.items():
            _hash(key, digest)
            _hash(value, digest)
    elif isinstance(obj, list | tuple):
        digest.update(f"L{len(obj)}:".encode())
        for value in obj:
            _hash(value, digest)
    else:  # what weights_only loading gives back: None, bool, int, float, str, bytes
        digest.update(f"{type(obj).__name__}{obj!r};".encode())


def load_checkpoint(path: Path, expected_config: dict[str, Any]) -> dict[str, Any]:
    """The state in ``path``, after checking that it is a whole checkpoint of this run."""
    state = _read(path, mmap=False)
    saved = state["config"]
    differ = [k for k in sorted(set(saved) | set(expected_config))
              if k not in _MAY_CHANGE and saved.get(k) != expected_config.get(k)]
    if differ:
        detail = "; ".join(f"{k}: {saved.get(k)!r} in the checkpoint, {expected_config.get(k)!r} now"
                           for k in differ)
        raise CheckpointError(f"{path} belongs to another run ({detail}). Resume with the "
                              f"checkpoint's settings, or {_KEEP.split('; ', 1)[1]}")
    return state


def read_config(path: Path) -> dict[str, Any]:
    """The config a checkpoint was written with (``config_dict``'s form), to resume with."""
    config: dict[str, Any] = _read(path, mmap=True)["config"]
    return config


_KEEP = "it was left as it is; start a new run with another --out, or delete the file"


def _read(path: Path, *, mmap: bool) -> dict[str, Any]:
    if not path.is_file():
        raise CheckpointError(f"there is no checkpoint to resume at {path}; start the run without "
                              "--resume, or point --out at the folder of the run to resume")
    keep = _KEEP
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as e:  # any failure to unpickle means the same thing: not a usable file
        reason = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise CheckpointError(f"{path} is not a readable remat training checkpoint "
                              f"({type(e).__name__}: {reason[:200]}); {keep}") from None
    if not isinstance(state, dict) or state.get("format") != _FORMAT:
        raise CheckpointError(f"{path} is not a remat training checkpoint; {keep}")
    if state.get("version") != _VERSION:
        raise CheckpointError(f"{path} is a training checkpoint of version {state.get('version')!r}; "
                              f"this remat reads version {_VERSION}; {keep}")
    missing = [k for k in _KEYS if k not in state]
    if missing:
        raise CheckpointError(f"{path} is incomplete (no {', '.join(missing)}); {keep}")
    try:
        actual = checksum({k: state[k] for k in _KEYS})
    except Exception as e:  # a value that cannot even be hashed is a damaged one
        actual = f"unhashable ({type(e).__name__})"
    if state.get("sha256") != actual:
        raise CheckpointError(f"{path} is damaged: its contents do not match its checksum (a "
                              f"changed or corrupted file); {keep}")
    return dict(state)


def rng_state() -> dict[str, Any]:
    """Every random generator a training step draws from: torch's CPU and CUDA ones, Python's."""
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        "python": random.getstate(),
    }


def set_rng_state(rng: dict[str, Any]) -> None:
    """Restore ``rng_state()``'s generators (CUDA's only where there is CUDA)."""
    torch.set_rng_state(rng["torch"])
    if rng["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    version, internal, gauss = rng["python"]
    random.setstate((version, tuple(internal), gauss))  # a list after a round trip through torch.load


def write_outputs(result: TrainResult, out: Path) -> None:
    """``log.json`` and (with matplotlib) ``loss.png`` in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    data = {
        "kind": "remat-train-log",
        "schema_version": LOG_SCHEMA,
        "config": {k: v for k, v in config_dict(result.config, "").items() if k != "text_sha256"},
        "completed_steps": result.completed_steps,
        "micro_batch": result.micro_batch,
        "accumulation_steps": result.accumulation_steps,
        "plan": json.loads(result.plan.to_json()) if result.plan is not None else None,
        "candidates": [dataclasses.asdict(c) for c in result.candidates],
        "budget_bytes": result.budget_bytes,
        "predicted_peak_bytes": result.predicted_peak_bytes,
        "measured_peak_bytes": result.measured_peak_bytes,
        "steps": [dataclasses.asdict(s) for s in result.steps],
        "evals": [dataclasses.asdict(e) for e in result.evals],
    }
    atomic_write(out / "log.json", json.dumps(data, indent=2) + "\n")
    try:
        plot_losses(result, out / "loss.png")
    except ImportError as e:
        log.warning("no loss plot: %s", e)


def plot_losses(result: TrainResult, path: Path) -> Path:
    """Training and held-out loss against the optimizer step (see NOTE [ Plots without pyplot ]
    in ``remat.report``)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise MissingDependency(f"the loss plot needs matplotlib ({e}); pip install 'remat[plot]'") from None
    fig = Figure(figsize=(8.0, 5.0), dpi=150, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.grid(True, color="0.88", lw=0.8)
    ax.set_axisbelow(True)
    ax.plot([s.step for s in result.steps], [s.loss for s in result.steps], color="#4C72B0",
            lw=1.2, label="training loss (global batch)")
    if result.evals:
        ax.plot([e.step for e in result.evals], [e.loss for e in result.evals], color="#DD8452",
                marker="o", lw=1.5, label="held-out loss")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy, nats per byte")
    plan = next((c.plan_summary for c in result.candidates if c.chosen), None)
    ax.set_title(f"{_model_name(result.config)}: micro-batch {result.micro_batch} × "
                 f"{result.accumulation_steps}, plan: {plan or 'none'}", fontsize=10)
    ax.legend(frameon=False)
    atomic_write(path, lambda f: fig.savefig(f, dpi=150, format="png"))
    return path


def _model_name(config: TrainConfig) -> str:
    return config.model if isinstance(config.model, str) else type(config.model).__name__
