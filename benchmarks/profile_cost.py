"""What profiling costs: real steps run, fake steps run, process CPU time, per way of profiling.

For each model: ``profile()`` without a budget (the plain step measured, as before NOTE [ Planning
what does not fit ]), with a budget the plain step fits (the same, after one fake step that
predicts it), and with a budget it does not fit (the lean profile: bytes from fake steps, times
and scratch from real steps predicted within the budget). Real and fake steps are counted at
``remat.measure.step.train_step``; CPU time is this process's, one torch thread. The last column
is the same profile with every garbage collection in full, as before NOTE [ One full collection
per call ] (``remat.measure.collector``); with transformers imported (``--transformers``, which
adds a tiny Llama) the process holds many more objects, and each full collection costs more. The
configurations run in turns, ``--rounds`` times, and the table has the medians.

    python benchmarks/profile_cost.py [--rounds 3] [--transformers] [--out bench-out/profile_cost.md]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from remat import models
from remat.measure import collector
from remat.measure import step as _step
from remat.measure import storages as _storages
from remat.measure.profiler import profile
from remat.measure.step_memory import measure_step


def _models() -> dict[str, Callable[[], tuple[Any, Any, Any]]]:
    def gpt(n_layer: int) -> Callable[[], tuple[Any, Any, Any]]:
        def build() -> tuple[Any, Any, Any]:
            torch.manual_seed(0)
            model = models.build_model(models.GPTConfig(n_layer=n_layer, n_embd=64, n_head=2, block_size=128,
                                                        vocab_size=256))
            return model, models.make_batch(model, batch_size=4, seq_len=128), models.loss_fn_for(model)
        return build

    def unet() -> tuple[Any, Any, Any]:
        torch.manual_seed(0)
        model = models.build_model(models.UNetConfig(image_size=32, channels=16))
        return model, models.make_batch(model, batch_size=4), models.loss_fn_for(model)

    return {"gpt (4 blocks)": gpt(4), "gpt (32 blocks)": gpt(32), "unet (12 blocks)": unet}


def _llama() -> tuple[Any, Any, Any]:
    """A tiny transformers Llama (4 layers, width 32), which computes its own loss."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(cfg).train()
    ids = torch.randint(3, 64, (4, 32), generator=torch.Generator().manual_seed(1))
    return model, {"input_ids": ids, "labels": ids}, None


class _Count:
    """Real and fake training steps, counted where every stage runs them."""

    def __init__(self) -> None:
        self.real = self.fake = 0
        self.inner = _step.train_step

    def __enter__(self) -> _Count:
        from torch._subclasses.fake_tensor import FakeTensor

        def counted(model: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
            if any(isinstance(t, FakeTensor) for t in _storages.tensors_in(batch)):
                self.fake += 1
            else:
                self.real += 1
            return self.inner(model, batch, *args, **kwargs)

        _step.train_step = counted  # type: ignore[assignment]
        return self

    def __exit__(self, *exc: Any) -> None:
        _step.train_step = self.inner  # type: ignore[assignment]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--transformers", action="store_true", help="add a tiny transformers Llama")
    parser.add_argument("--out", type=Path, default=Path("bench-out/profile_cost.md"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    builds = _models() | ({"transformers Llama (4 blocks)": _llama} if args.transformers else {})
    once = collector.collected_once
    rows = []
    for name, build in builds.items():
        model, batch, loss_fn = build()
        plain = measure_step(model, batch, loss_fn=loss_fn, repeats=0).peak_bytes
        ways = {"no budget (as before)": None, "budget = plain peak": plain, "budget = 60% (lean)": int(0.6 * plain)}
        runs: dict[tuple[str, bool], list[tuple[int, int, float]]] = {(w, f): [] for w in ways for f in (False, True)}
        for _ in range(args.rounds):
            for (way, in_full), r in runs.items():
                collector.collected_once = contextlib.nullcontext if in_full else once  # type: ignore[assignment]
                t0 = time.process_time()
                with _Count() as count:
                    profile(model, batch, loss_fn=loss_fn, repeats=1, budget=ways[way])
                r.append((count.real, count.fake, time.process_time() - t0))
        collector.collected_once = once  # type: ignore[assignment]
        for way in ways:
            now, full = runs[(way, False)], runs[(way, True)]
            rows.append((name, way, now[0][0], now[0][1], statistics.median(x[2] for x in now),
                         statistics.median(x[2] for x in full)))
    lines = ["| model | profile | real steps | fake steps | CPU s (median) | CPU s, collecting in full |",
             "| --- | --- | ---: | ---: | ---: | ---: |"]
    lines += [f"| {m} | {w} | {real} | {fake} | {cpu:.1f} | {full:.1f} |" for m, w, real, fake, cpu, full in rows]
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)


if __name__ == "__main__":
    main()
