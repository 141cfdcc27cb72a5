"""The loss head as a planned segment: what chunking the head buys, measured and estimated.

    .venv/bin/python benchmarks/head.py [--part measured|estimated|both] [--repeats 3]
        [--layers 32] [--points 8] [--out bench-out/head.md]

- measured (this CPU): a transformers LlamaForCausalLM with a 32000-token vocabulary (hidden 64,
  4 layers, batch 2 x 384, labels given). One ``remat.profile``; the optimal frontier with the head
  options (``keep`` and ``chunked:<tokens>``, NOTE [ The head's options ]) and without them (the
  same profile, head options removed); every frontier plan applied and its peak measured with
  ``remat.measure_step``; the smallest plan's loss and gradients compared with the plain step's.
- estimated (an H100, fake tensors, nothing allocated): the Llama-3-8B shape (vocab 128256,
  hidden 4096, 32 layers, seq 8192, batch 1, bf16, AdamW): remat's built-in Llama with its plain
  head, and the same model whose loss is ``remat.chunked_cross_entropy`` of its hidden states; the
  smallest feasible peak of each, and the fastest plan that fits the device. ``--layers`` makes it
  shallower (the head's share does not depend on depth).

Prints markdown tables (and writes them to ``--out``). Overheads are the cost model's predictions
from the profile (CPU time on the CPU, NOTE [ CPU time on a shared CPU ]; the roofline in
estimated mode); peaks in the measured part are measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

import torch
from torch import nn

import remat
from remat import models
from remat.plan.costmodel import smallest_feasible
from remat.plan.head import head_names, with_head
from remat.plan.sharding import per_rank_profile
from remat.plan.solver import frontier, solve
from remat.records import Plan, Profile, Segment
from remat.units import format_bytes

MIB = 2**20


def llama_32k() -> tuple[nn.Module, dict[str, torch.Tensor], object]:
    from remat.models.hf import build

    return build("llama", batch_size=2, seq_len=384, vocab_size=32000, max_position_embeddings=512)


def _choices(plan: Plan) -> str:
    counts: dict[str, int] = {}
    for o in plan.choices.values():
        counts[o] = counts.get(o, 0) + 1
    return ", ".join(f"{n} {o}" for o, n in counts.items())


def measured_part(repeats: int, points: int) -> str:
    from remat.verifier import verify_many

    model, batch, loss_fn = llama_32k()
    t0 = time.perf_counter()
    prof = remat.profile(model, batch, loss_fn=loss_fn, repeats=repeats)
    profile_s = time.perf_counter() - t0
    without = dataclasses.replace(prof, head_options={})
    labelled = [("without", plan) for plan in frontier(without, points=points)]
    labelled += [("with", plan) for plan in frontier(prof, points=points)]
    reports = verify_many(model, batch, [p for _, p in labelled], loss_fn=loss_fn, repeats=repeats)
    plain = reports[0].plain_peak_bytes
    rows = ["| head options | head | blocks | predicted peak | measured peak | of plain | predicted overhead | "
            "measured overhead | gradients |", "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | :-: |"]  # fmt: skip
    for (label, plan), r in zip(labelled, reports):
        rows.append(
            f"| {label} | {plan.head} | {_choices(plan)} | {format_bytes(plan.estimate.peak_bytes)} | "
            f"{format_bytes(r.measured_peak_bytes)} | {r.measured_peak_bytes / plain:.1%} | "
            f"{plan.estimate.overhead:+.1%} | {r.measured_overhead:+.1%} | {'=' if r.grads_equal else 'DIFFER'} |"
        )
    low = {label: min(p.estimate.peak_bytes for lab, p in labelled if lab == label) for label in ("without", "with")}
    head = (
        f"### Measured: transformers Llama, vocab 32000, hidden 64, 4 layers, batch 2 x 384 (CPU)\n\n"
        f"Plain step: {format_bytes(plain)}, {reports[0].plain_step_ms:.0f} ms of CPU time; profile: "
        f"{profile_s:.0f} s; head options {head_names(prof)[1:]}. Smallest feasible without head "
        f"options {format_bytes(low['without'])} ({low['without'] / plain:.1%} of plain), with them "
        f"{format_bytes(low['with'])} ({low['with'] / plain:.1%}). Every plan verified with "
        f"`remat.verify` (steps timed in turns with the plain step, medians of {repeats}; plain against "
        f"itself {reports[0].plain_self_overhead:+.1%}; gradients against plain: = is bit for bit, or "
        f"to round-off for a chunked head or tiled MLP, largest difference "
        f"{max(r.max_grad_diff for r in reports):.1e}).\n\n"
    )
    return head + "\n".join(rows) + "\n"


# --- estimated: the Llama-3-8B shape on an H100 --------------------------------------------------


class ChunkedLoss(nn.Module):
    """remat's Llama whose forward returns the loss: ``remat.chunked_cross_entropy`` of its final
    hidden states and its ``lm_head`` (next-token targets), so the planner finds the head."""

    def __init__(self, lm: models.decoders.Llama) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        lm, cfg = self.lm, self.lm.config
        hidden = lm.embed_tokens(idx)
        cos, sin = models.decoders.rope_cos_sin(idx.shape[1], cfg.dim // cfg.n_head, cfg.rope_theta,
                                                device=idx.device, dtype=hidden.dtype)  # fmt: skip
        for layer in lm.layers:
            hidden = layer(hidden, position_embeddings=(cos, sin))[0]
        return remat.chunked_cross_entropy(lm.norm(hidden), lm.lm_head, idx, chunk_size=idx.numel(), shift=True)


def llama3_8b_profiles(layers: int = 32, seq: int = 8192) -> tuple[Profile, Profile]:
    """(plain head, chunked-loss head) estimated profiles of the Llama-3-8B shape on an H100."""
    from remat.models.zoo import ZOO

    cfg = dataclasses.replace(ZOO["llama-8b"].config, n_layer=layers, max_seq=seq)

    def plain() -> nn.Module:
        return models.build_model(cfg, dtype=torch.bfloat16)

    def chunked() -> nn.Module:
        return ChunkedLoss(models.build_model(cfg, dtype=torch.bfloat16))  # type: ignore[arg-type]

    def batch() -> tuple[torch.Tensor]:
        return (torch.zeros(1, seq, dtype=torch.long),)

    def opt(ps: object) -> torch.optim.Optimizer:
        return torch.optim.AdamW(ps)  # type: ignore[arg-type]

    a = remat.profile(plain, batch, loss_fn=models.lm_loss, optimizer=opt, device="h100")
    b = remat.profile(chunked, batch, optimizer=opt, device="h100")
    return a, b


def _head_peak(seg: Segment) -> int:
    """The head's own peak: the higher of its forward's working memory and what it keeps plus its
    backward's working memory."""
    return max(seg.fwd_peak_bytes, seg.kept_bytes + seg.bwd_peak_bytes)


def _fastest_fit(p: Profile) -> Plan | None:
    assert p.device_memory_bytes is not None
    try:
        return solve(p, p.device_memory_bytes)
    except remat.InfeasibleBudget:
        return None


def estimated_part(layers: int) -> str:
    t0 = time.process_time()
    plain, chunked = llama3_8b_profiles(layers)
    seconds = time.process_time() - t0
    rows = ["| ranks | loss head | the head's own peak | plain step | smallest feasible | fastest plan in 80 GiB "
            "| its overhead |", "| --- | --- | ---: | ---: | ---: | --- | ---: |"]  # fmt: skip
    summary = []
    for ranks in (1, 8):
        lows = []
        for label, p in (("as written", plain), ("chunked_cross_entropy, planned", chunked)):
            p = per_rank_profile(p, world_size=ranks, fsdp=ranks > 1)
            low, where_low = min(smallest_feasible(with_head(p, h)) for h in head_names(p))
            lows.append(low)
            fit = _fastest_fit(p)
            where = f"head {fit.head}; {_choices(fit)}" if fit else "none fits"
            over = f"{fit.estimate.overhead:+.1%}" if fit else "-"
            own = min(_head_peak(with_head(p, h).post) for h in head_names(p))
            rows.append(f"| {'1' if ranks == 1 else f'{ranks} (FSDP)'} | {label} | {format_bytes(own)} | "
                        f"{format_bytes(p.plain_peak_bytes)} | {format_bytes(low)} | {where} | {over} |")  # fmt: skip
        gain = max(lows[0] - lows[1], 0) if abs(lows[0] - lows[1]) >= MIB else 0
        summary.append(f"{format_bytes(gain)} ({gain / lows[0]:.1%}) on "
                       f"{'one GPU' if ranks == 1 else f'each of {ranks} FSDP ranks'} (there, with the "
                       f"head option, {where_low})")  # fmt: skip
    return (
        f"### Estimated: Llama-3-8B shape (vocab 128256, seq 8192, batch 1, bf16, AdamW, {layers} layers) "
        f"on an H100\n\nThe head option lowers the smallest feasible peak by {' and by '.join(summary)}; "
        f"head options {head_names(chunked)[1:]}; both profiles took {seconds:.0f} s of CPU time.\n\n"
        + "\n".join(rows) + "\n"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=["measured", "estimated", "both"], default="both")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--points", type=int, default=8)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--out", type=Path, default=Path("bench-out/head.md"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    parts = []
    if args.part in ("measured", "both"):
        parts.append(measured_part(args.repeats, args.points))
    if args.part in ("estimated", "both"):
        parts.append(estimated_part(args.layers))
    text = "\n".join(parts)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)


if __name__ == "__main__":
    main()
