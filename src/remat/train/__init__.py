"""Training a language model on text within a memory budget: ``train(TrainConfig(...))``."""

from remat.train.loop import (
    PRECISIONS,
    CheckpointError,
    EvalLog,
    StepLog,
    TrainConfig,
    TrainInterrupted,
    TrainResult,
    accumulate,
    build_text_model,
    text_loss,
    train,
)

__all__ = [
    "PRECISIONS",
    "CheckpointError",
    "EvalLog",
    "StepLog",
    "TrainConfig",
    "TrainInterrupted",
    "TrainResult",
    "accumulate",
    "build_text_model",
    "text_loss",
    "train",
]
