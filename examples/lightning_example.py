"""A Lightning training run under a memory budget chosen by remat.

    python examples/lightning_example.py [--budget 70%] [--steps 4]

A small BERT (``BertForMaskedLM`` from a config, nothing downloaded) learns masked-byte prediction
on Python's documentation (``pydoc_data.topics``). remat plans and applies on the LightningModule's
inner model before ``trainer.fit``; Lightning then trains it as usual. See docs/integrations.md.
"""

from __future__ import annotations

import argparse
from pydoc_data.topics import topics
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset
from transformers import BertConfig, BertForMaskedLM

import remat

try:
    import lightning.pytorch as pl
except ImportError:  # the standalone package
    import pytorch_lightning as pl  # type: ignore[no-redef]

MASK_ID = 0  # a byte value that does not occur in the text


def masked(ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """Every 7th byte (~15%, as in BERT) replaced by the mask id and predicted."""
    labels = torch.full_like(ids, -100)
    labels[:, ::7] = ids[:, ::7]
    inputs = ids.clone()
    inputs[:, ::7] = MASK_ID
    return {"input_ids": inputs, "labels": labels}


class MaskedLM(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        config = BertConfig(vocab_size=256, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                            intermediate_size=256, max_position_embeddings=128, pad_token_id=MASK_ID)
        self.model = BertForMaskedLM(config)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.model(**masked(batch[0])).loss
        self.log("loss", loss, prog_bar=False)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.model.parameters(), lr=1e-3)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", default="70%", help='peak memory of a step: "6GiB", bytes, or "70%%" of plain')
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args(argv)

    pl.seed_everything(0, verbose=False)
    module = MaskedLM()
    text = "\n\n".join(topics[k] for k in sorted(topics)).encode()
    data = torch.tensor(list(text[: 8 * args.steps * 128]), dtype=torch.long).view(-1, 128)
    loader = DataLoader(TensorDataset(data), batch_size=8, shuffle=False)

    # 1. remat, on the inner model and one real batch, with the optimizer Lightning will make.
    module.model.train()
    plan = remat.auto(module.model, masked(next(iter(loader))[0]), args.budget,
                      optimizer=module.configure_optimizers(), repeats=1)
    print(f"remat plan: {plan.choices}")
    print(f"predicted peak {plan.estimate.peak_bytes / 2**20:.1f} MiB, budget {plan.budget_bytes / 2**20:.1f} MiB")

    # 2. Lightning, as usual.
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=args.steps, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, loader)
    assert remat.applied_plan(module.model) is plan
    print(f"trained {trainer.global_step} steps, last loss {trainer.callback_metrics['loss'].item():.4f}")


if __name__ == "__main__":
    main()
