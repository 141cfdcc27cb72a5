"""A plain PyTorch training loop under 🤗 Accelerate, with a memory budget chosen by remat.

    python examples/accelerate_example.py [--budget 70%] [--steps 4]
    accelerate launch examples/accelerate_example.py      # the same, on whatever `accelerate config` says

A small Llama (from a config, nothing downloaded) learns Python's documentation byte by byte
(``pydoc_data.topics``). remat plans and applies on the bare model, *before*
``accelerator.prepare``: the plan lives on the layers themselves, so it is still there inside the
DDP/FSDP wrapper that ``prepare`` may put around the model. See docs/integrations.md.
"""

from __future__ import annotations

import argparse
from pydoc_data.topics import topics

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset
from transformers import LlamaConfig, LlamaForCausalLM

import remat


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", default="70%", help='peak memory of a step: "6GiB", bytes, or "70%%" of plain')
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args(argv)

    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         bos_token_id=10, eos_token_id=10, use_cache=False)
    model = LlamaForCausalLM(config).to(accelerator.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    text = "\n\n".join(topics[k] for k in sorted(topics)).encode()
    data = torch.tensor(list(text[: 8 * args.steps * 128]), dtype=torch.long).view(-1, 128)
    loader = DataLoader(TensorDataset(data), batch_size=8, shuffle=False)

    # 1. remat, on the bare model and one real batch (a dict, as the loop below calls the model).
    ids = next(iter(loader))[0].to(accelerator.device)
    example = {"input_ids": ids, "labels": ids}
    model.train()
    plan = remat.auto(model, example, args.budget, optimizer=optimizer, repeats=1)
    accelerator.print(f"remat plan: {plan.choices}")
    accelerator.print(f"predicted peak {plan.estimate.peak_bytes / 2**20:.1f} MiB, "
                      f"budget {plan.budget_bytes / 2**20:.1f} MiB")

    # 2. accelerate, as usual.
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    assert remat.applied_plan(accelerator.unwrap_model(model)) is plan
    losses = []
    for (ids,) in loader:
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(round(loss.item(), 4))
    accelerator.print(f"trained {len(losses)} steps, losses {losses}")


if __name__ == "__main__":
    main()
