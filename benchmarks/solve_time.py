"""How long ``solve(method="optimal")`` takes on long chains: 32, 128 and 512 blocks with all five
options (a GPU's), or with the three a CPU offers (no offload: where segments win at tight
budgets, so the segment search runs in full), made of identical blocks (repeated decoder layers),
of blocks with identical bytes and slightly different times (what measuring repeated layers
gives), or of blocks whose every number differs (the hard case for the search). Prints a
markdown table.

    .venv/bin/python benchmarks/solve_time.py [--repeats 5]

Budgets are 10%, 50% and 90% of the way from the smallest feasible peak to the plain step's peak.
Times are medians over repeats, in one process, wall-clock with CPU time beside it; no torch is
imported.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from remat.plan.costmodel import estimate, smallest_feasible
from remat.plan.solver import solve
from remat.records import BlockProfile, OptionCost, Profile, Segment

MIB = 2**20
# One decoder layer of a mid-sized model, per option: kept MiB, forward and backward transient
# MiB, extra ms. Recompute keeps the input only and brings the activations back in the backward.
LAYER = {
    "keep": (400, 200, 300, 0.0),
    "selective": (150, 200, 350, 1.2),
    "recompute": (32, 200, 650, 6.0),
    "offload": (0, 220, 700, 2.5),
    "recompute_offload": (0, 200, 690, 7.0),
}
SHARES = (0.1, 0.5, 0.9)
KINDS = ("identical", "noisy", "varied")


def chain(n: int, kind: str, *, seed: int = 0, width: int = 5) -> Profile:
    """``width`` options per block (5: all; 3: keep, selective, recompute). ``identical`` blocks; ``noisy``: identical bytes, times off by up to 3% as measured times
    are; ``varied``: every number of every block drawn from 0.7x..1.4x."""
    rng = random.Random(seed)
    spread = {"identical": 0.0, "noisy": 0.0, "varied": 0.35}[kind]
    ms_spread = {"identical": 0.0, "noisy": 0.03, "varied": 0.35}[kind]

    def jitter(x: float) -> float:
        return x * rng.uniform(1 - spread, 1 + 2 * spread) if spread else x

    def jitter_ms(x: float) -> float:
        return x * rng.uniform(1 - ms_spread, 1 + ms_spread) if ms_spread else x

    blocks = []
    for i in range(n):
        options = {
            name: OptionCost(
                kept_bytes=int(jitter(kept) * MIB),
                fwd_peak_bytes=int(jitter(fwd) * MIB),
                bwd_peak_bytes=int(jitter(bwd) * MIB),
                extra_ms=jitter_ms(ms),
            )
            for name, (kept, fwd, bwd, ms) in list(LAYER.items())[:width]
        }
        blocks.append(
            BlockProfile(
                name=f"layers.{i}",
                kind="Layer",
                param_bytes=int(jitter(50) * MIB),
                grad_bytes=int(jitter(50) * MIB),
                input_bytes=32 * MIB,
                fwd_ms=jitter(6.0),
                bwd_ms=jitter(12.0),
                options=options,
            )
        )
    segment = Segment(
        kept_bytes=200 * MIB,
        fwd_peak_bytes=800 * MIB,
        bwd_peak_bytes=900 * MIB,
        grad_bytes=100 * MIB,
        fwd_ms=3.0,
        bwd_ms=6.0,
    )
    return Profile(
        model="Synthetic",
        fingerprint="0" * 16,
        device="cuda" if width == 5 else "cpu",
        mode="estimated",
        dtype="bfloat16",
        batch_shape=[8, 2048],
        base_bytes=n * 150 * MIB,
        param_bytes=n * 50 * MIB,
        optimizer_bytes=n * 100 * MIB,
        batch_bytes=1 * MIB,
        optimizer_peak_bytes=0,
        pre=segment,
        post=segment,
        blocks=blocks,
        plain_peak_bytes=0,
        plain_step_ms=n * 18.0,
    )


def median_ms(profile: Profile, budget: int, repeats: int) -> tuple[float, float]:
    """Median wall-clock and CPU milliseconds of one solve (CPU time is what a busy machine
    does not inflate)."""
    wall, cpu = [], []
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        solve(profile, budget)
        wall.append((time.perf_counter() - start) * 1e3)
        cpu.append((time.process_time() - start_cpu) * 1e3)
    return statistics.median(wall), statistics.median(cpu)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--blocks", type=int, nargs="+", default=[32, 128, 512])
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    parser.add_argument("--options", type=int, nargs="+", choices=(3, 5), default=[5, 3],
                        help="5: every option (a GPU's); 3: keep, selective, recompute (a CPU's)")
    args = parser.parse_args()
    header = " | ".join(f"{int(s * 100)}% budget" for s in SHARES)
    print(f"| blocks x options | chain | {header} |")
    print("| --- | --- |" + " --- |" * len(SHARES))
    for width in args.options:
        for n in args.blocks:
            for kind in args.kinds:
                profile = chain(n, kind, width=width)
                low, _ = smallest_feasible(profile)
                high = estimate(profile, {b.name: "keep" for b in profile.blocks}).peak_bytes
                cells = []
                for share in SHARES:
                    budget = int(low + share * (high - low))
                    solve(profile, budget)  # warm-up
                    wall, cpu = median_ms(profile, budget, args.repeats)
                    cells.append(f"{wall:.1f} ms (cpu {cpu:.1f})")
                print(f"| {n} x {width} | {kind} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
