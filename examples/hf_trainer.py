"""Train a transformers model with the Trainer under a memory budget chosen by remat.

    python examples/hf_trainer.py [--budget 70%] [--steps 4]

A small GPT-2 (from a config, nothing downloaded) learns to continue Python's own documentation,
byte by byte (``pydoc_data.topics``, shipped with CPython). The one remat line is ``remat.auto``
on the model and one example batch, *before* the Trainer gets the model; the Trainer's own
``activation_checkpointing`` (formerly ``gradient_checkpointing``) stays off, since remat's plan
replaces it: only the layers the plan names are recomputed. See docs/integrations.md.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from pydoc_data.topics import topics

import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainingArguments,
    default_data_collator,
)

import remat


def byte_dataset(seq_len: int, n: int) -> list[dict[str, torch.Tensor]]:
    """``n`` windows of ``seq_len`` UTF-8 bytes of the pydoc topics; labels = inputs (the model
    shifts them)."""
    data = torch.tensor(list("\n\n".join(topics[k] for k in sorted(topics)).encode()), dtype=torch.long)
    rows = data[: n * seq_len].view(n, seq_len)
    return [{"input_ids": row, "labels": row} for row in rows]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", default="70%", help='peak memory of a step: "6GiB", bytes, or "70%%" of plain')
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", type=Path, default=None, help="output directory (default: a temporary one)")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=256, n_positions=128, n_embd=64, n_layer=4, n_head=4,
                        bos_token_id=10, eos_token_id=10, use_cache=False)
    model = GPT2LMHeadModel(config)
    dataset = byte_dataset(seq_len=128, n=8 * args.steps)
    batch_size = 8

    # 1. remat: profile one training step on a real batch, choose the layers to recompute, apply.
    #    The budget counts optimizer state: profile with the kind of optimizer the Trainer makes
    #    (AdamW; its state is created in the profiling steps and dropped again afterwards).
    example = default_data_collator(dataset[:batch_size])
    model.train()
    adamw = torch.optim.AdamW(model.parameters())
    plain = remat.measure_step(model, example, optimizer=adamw, repeats=0)
    plan = remat.auto(model, example, args.budget, optimizer=adamw, repeats=1)
    planned = remat.measure_step(model, example, optimizer=adamw, repeats=0)
    print(f"remat plan: {plan.choices}")
    print(f"measured peak of a step: plain {plain.peak_bytes / 2**20:.1f} MiB, with the plan "
          f"{planned.peak_bytes / 2**20:.1f} MiB (budget {plan.budget_bytes / 2**20:.1f} MiB)")
    del adamw

    # 2. the Trainer, as usual; activation checkpointing left off (remat's plan does it).
    with tempfile.TemporaryDirectory() as tmp:
        out = args.out or Path(tmp)
        training = TrainingArguments(
            output_dir=str(out / "trainer"), max_steps=args.steps, per_device_train_batch_size=batch_size,
            learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to="none", use_cpu=True,
            disable_tqdm=True, dataloader_num_workers=0, seed=0,
        )
        trainer = Trainer(model=model, args=training, train_dataset=dataset, data_collator=default_data_collator)
        result = trainer.train()
        losses = [round(log["loss"], 4) for log in trainer.state.log_history if "loss" in log]
        print(f"trained {result.global_step} steps, losses {losses}")

        # The plan is still in place, and the Trainer's model is the one remat planned.
        assert trainer.model is model and remat.applied_plan(model) is plan
        assert [remat.option_of(layer) for layer in model.transformer.h] == list(plan.choices.values())

        # Saving is unaffected: the files hold only the model's own config and weights.
        model.save_pretrained(out / "model")
        reloaded = GPT2LMHeadModel.from_pretrained(out / "model")
        assert all(torch.equal(p, q) for p, q in zip(model.state_dict().values(), reloaded.state_dict().values()))
        print(f"saved and reloaded {out / 'model'}")


if __name__ == "__main__":
    main()
