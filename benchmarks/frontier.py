"""remat side by side with PyTorch's own options on the memory / step-time frontier.

    .venv/bin/python benchmarks/frontier.py [--models gpt,llama,cnn,unet,bias-lm,hf-gpt2,hf-llama]
        [--out bench-out] [--repeats 5] [--device cpu|cuda] [--quick]

For each model, in one process and with one measurement: the plain step; torch checkpointing on
every block and on every 2nd and 3rd block; ``checkpoint_sequential`` with sqrt(n) segments;
``torch.compile`` with ``activation_memory_budget`` 1.0, 0.5 and 0.2; and remat's optimal plan
(``solve`` on a remat ``profile``) at a budget equal to each of those peaks, and at budgets below
the lowest of them, down to the smallest feasible. (The peers: NOTE [ The peers ] in _peers.py.)

Peak bytes come from ``remat.measure_step`` (the CPU allocator's record of every storage;
on CUDA the caching allocator's counters). Step times are medians of ``--repeats`` steps taken in
turns (NOTE [ Interleaved timing ]); overhead = step time / plain step time - 1.

The bar, checked and printed for every model: at each peer's measured peak, remat's plan measures
a peak within that budget and an overhead no more than 2 points above the peer's. A pair that
misses the overhead bar is timed again, head to head, in turns, until the median of its paired
ratios is known on one side of the bar (NOTE [ Judging a pair ]), before it is called a loss;
losses are reported with the reason, never dropped.

Writes per model ``<model>.md``, ``<model>.json`` and ``<model>.png`` (the frontier) into
``--out``, and all models' bar tables in ``README-table.md``. Exit status 0; with ``--strict``, 1
when a model misses the bar.

# NOTE [ Interleaved timing ]
A shared CPU drifts (other processes, clocks, thermals) over the seconds a benchmark runs. Timing
each configuration's steps in one block would charge that drift to whichever ran at a bad moment.
So every configuration first runs one untimed step, then the timed steps go round by round, one
step of each configuration per round, in an order rotated (and reversed every other round) from
round to round, and each configuration's time is the median of its steps. As in ``timeit``, the
garbage collector is off during the timed steps (it runs between rounds). Switching a
configuration on or off sets or removes instance attributes only (no copies of the model).

# NOTE [ Judging a pair ]
On a shared 2-core CPU one round's ratio of two GPT steps spreads by +-4% (quartiles; 30 rounds of
remat's plan against torch's every 3rd block), so the median of 10 rounds is known to about +-2.5
points: a fixed-length rerun cannot tell a 2-point loss from noise, and one pair flipped from
-5.1 points in the main run to +2.8 in its rerun. A pair more than 2 points apart is therefore
timed again, the two alone, in batches of ``2 * repeats`` rounds, until the 95% interval of the
median ratio (distribution-free: order statistics) lies on one side of the bar, or for at most
``RERUN_BATCHES`` batches; it is judged on the median over all its rerun rounds, and the interval
is reported beside it. Both outcomes stop the rerun alike, so it confirms a win as readily as a
loss.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _peers import (
    HF_MODELS,
    MODELS,
    Case,
    CompileTimeout,
    Config,
    build_case,
    compiled,
    every_k,
    plain,
    remat_plan,
    sequential,
    time_limit,
    transformers_missing,
)

from remat.measure import clock
from remat.measure import step as _step
from remat.measure import storages as _storages
from remat.measure.preserve import preserved
from remat.measure.profiler import profile
from remat.measure.step_memory import measure_step
from remat.plan.costmodel import estimate
from remat.plan.head import HEAD_KEEP
from remat.plan.solver import InfeasibleBudget, smallest_any, solve
from remat.records import Plan, Profile
from remat.report import FrontierPoint, markdown_table, plot_frontier
from remat.units import format_bytes

SCHEMA = 1
NOISE = 0.02  # the bar's allowance for timing noise: 2 points of overhead
RERUN_BATCHES = 4  # a pair's rerun: at most this many batches of 2 x repeats rounds
COMPILE_BUDGETS = (1.0, 0.5, 0.2)
BELOW = (2 / 3, 1 / 3, 0.0)  # remat-only budgets: shares of the way from the floor to the lowest peer
BAR_RULE = (
    "Budget = the peer's measured peak. remat's plan for that budget passes the bar when its "
    "measured peak is within the budget and its overhead is at most 2 points above the peer's. A "
    "pair more than 2 points apart (either way) is timed again, the two alone, in turns, in "
    "batches of twice the rounds until the 95% interval of the median is on one side of the bar "
    "(at most 4 batches), and judged on that rerun: the median over its rounds of remat's step "
    "over the peer's, in overhead points (column 'remat − peer', its interval in brackets; the "
    "overheads are from the main run)."
)
LETTERS = {"keep": "K", "selective": "S", "recompute": "R", "offload": "O", "recompute_offload": "B"}


def log(message: str) -> None:
    print(message, flush=True)


# --- measuring ----------------------------------------------------------------------------------


@dataclass
class Measured:
    """What one configuration measured."""

    peak_bytes: int = 0
    times_ms: list[float] = field(default_factory=list)

    @property
    def step_ms(self) -> float:
        return statistics.median(self.times_ms)


def measure_memory(case: Case, config: Config, *, warmup: int) -> int:
    with config.active() as runner:
        mem = measure_step(runner, case.batch, loss_fn=case.loss_fn, optimizer=case.optimizer,
                           repeats=0, warmup=warmup)
    return mem.peak_bytes


class Clock:
    """Milliseconds of one step: wall-clock (CUDA synchronised) or this process's CPU time.

    # NOTE [ CPU time on a shared CPU ]
    On a CPU shared with other processes, a step's wall-clock time depends on how much of the
    cores the others take at that moment: on the 2-core machine this was written on, plain steps of
    one configuration varied by +-30% from one step to the next. The CPU time the process itself
    spends (``time.process_time``, all its threads) counts the work of the step, not the waiting,
    and varied by a few percent. So on the CPU the bar is judged on CPU time (``--clock cpu``, the
    default there) and wall-clock times are recorded next to it; on CUDA, wall-clock time with
    synchronisation is the only meaningful clock.
    """

    def __init__(self, kind: str, device: torch.device) -> None:
        self.kind, self.device = kind, device

    def step(self, case: Case, runner: torch.nn.Module) -> tuple[float, float]:
        """(chosen clock ms, wall ms) of one training step."""
        clock.sync(self.device)
        w0, c0 = time.perf_counter(), time.process_time()
        _step.train_step(runner, case.batch, case.loss_fn, case.optimizer)
        clock.sync(self.device)
        wall, cpu = (time.perf_counter() - w0) * 1e3, (time.process_time() - c0) * 1e3
        return (cpu if self.kind == "cpu" else wall), wall


def time_interleaved(case: Case, configs: list[Config], repeats: int, clock: Clock
                     ) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Step times of ``configs`` (chosen clock, and wall), taken in turns (NOTE [ Interleaved
    timing ])."""
    times: dict[str, list[float]] = {c.name: [] for c in configs}
    walls: dict[str, list[float]] = {c.name: [] for c in configs}
    n = len(configs)
    with preserved(case.model, case.optimizer):
        for c in configs:  # one untimed step each
            with c.active() as runner:
                _step.train_step(runner, case.batch, case.loss_fn, case.optimizer)
        for r in range(repeats):
            shift = r * n // repeats  # starting points spread over the list, not 0, 1, 2, ...
            order = configs[shift:] + configs[:shift]
            gc.collect()  # the garbage collector runs between rounds, not inside a timed step
            gc.disable()
            try:
                for c in reversed(order) if r % 2 else order:
                    with c.active() as runner:
                        t, w = clock.step(case, runner)
                    times[c.name].append(t)
                    walls[c.name].append(w)
            finally:
                gc.enable()
    return times, walls


def compile_now(case: Case, config: Config, timeout_s: float) -> None:
    """Compile ``config`` with one step under a time limit; on failure set ``config.error``."""
    t0 = time.perf_counter()
    try:
        with time_limit(timeout_s), preserved(case.model, case.optimizer), \
                config.active() as runner:
            _step.train_step(runner, case.batch, case.loss_fn, case.optimizer)
    except Exception as e:  # a compile failure is a result to report, not a crash
        root = _root_cause(e)
        if isinstance(root, CompileTimeout):  # (dynamo appends its traceback to the message)
            config.error = f"failed: compiling took longer than the {timeout_s:g} s limit"
        else:
            first = (str(root).strip().splitlines() or [""])[0][:160]
            config.error = f"failed: {type(root).__name__}: {first}"
    elapsed = time.perf_counter() - t0
    config.extra["compile_s"] = round(elapsed, 1)
    if not config.error and elapsed >= timeout_s:
        # The limit's exception was caught inside torch (which may then fall back to eager for
        # this function): what ran is not known to be the compiled block, so it is not measured.
        config.error = f"failed: compiling took longer than the {timeout_s:g} s limit"


def _root_cause(e: BaseException) -> BaseException:
    """The innermost exception: dynamo wraps a backend's error in BackendCompilerFailed."""
    seen = set()
    while id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, CompileTimeout):
            return e
        nxt = e.__cause__ or e.__context__
        if nxt is None:
            return e
        e = nxt
    return e


def _stop_compile_workers() -> None:
    """inductor keeps a pool of compile workers; idle, they still take memory and a core's share."""
    try:
        from torch._inductor.async_compile import shutdown_compile_workers
    except ImportError:
        return
    shutdown_compile_workers()


def median_interval(xs: list[float]) -> tuple[float, float]:
    """A distribution-free 95% interval of the median of ``xs``: the order statistics at ranks
    (n - 1.96 sqrt(n)) / 2 and 1 + (n + 1.96 sqrt(n)) / 2, rounded (the binomial's normal
    approximation)."""
    s, n = sorted(xs), len(xs)
    half = 1.96 * math.sqrt(n)
    lo, hi = max(1, round((n - half) / 2)), min(n, round(1 + (n + half) / 2))
    return s[lo - 1], s[hi - 1]


def _noise(times: list[float]) -> float:
    """Half the interquartile range over the median: a typical deviation of one step."""
    if len(times) < 4:
        return float("nan")
    q1, _, q3 = statistics.quantiles(times, n=4)
    return (q3 - q1) / 2 / statistics.median(times)


# --- one model ----------------------------------------------------------------------------------


def letter(option: str) -> str:
    """``LETTERS``, and for ``compiled:<budget>`` the budget's first decimal (1 for budget 1)."""
    if option.startswith("compiled:"):
        budget = float(option.removeprefix("compiled:"))
        return "1" if budget >= 1 else str(int(budget * 10 + 1e-9))
    return LETTERS.get(option, "?")


def summary(plan: Plan) -> str:
    """One letter per block: K keep, S selective, R recompute, O offload, B recompute+offload, a
    digit d compiled at activation budget 0.d (1: budget 1); a segment in brackets, nested ones
    inside (its blocks K: kept during its replay); then the head option, when the plan has one
    other than ``keep`` (e.g. ``+chunked:128``)."""
    names = list(plan.choices)
    spans = [(names.index(a), names.index(b)) for a, b in plan.segments]
    out = []
    for i, o in enumerate(plan.choices.values()):
        out.append("[" * sum(a == i for a, _ in spans) + letter(o)
                   + "]" * sum(b == i for _, b in spans))
    return "".join(out) + (f"+{plan.head}" if plan.head not in (None, HEAD_KEEP) else "")


def run_model(name: str, args: argparse.Namespace) -> dict[str, Any]:
    t_start = time.perf_counter()
    device = torch.device(args.device)
    case = build_case(name, size=args.size, device=device, dtype=args.dtype)
    clock = Clock(args.clock, device)
    # One real step first: the optimizer's state exists from here on, so on the CPU (no caching
    # allocator to warm) a memory measurement needs no warm-up step of its own.
    _step.train_step(case.model, case.batch, case.loss_fn, case.optimizer)
    warmup = 0 if device.type == "cpu" else 1
    n = len(case.blocks)
    log(f"\n== {name}: {case.title} ({n} blocks) on {device}")
    configs: list[Config] = [plain(case), every_k(case, 1), every_k(case, 2), every_k(case, 3),
                             sequential(case)]
    for budget in COMPILE_BUDGETS:
        c = compiled(case, budget)
        configs.append(c)
        left = args.compile_total - args.compile_spent
        if name not in args.compile:
            c.error = "not run: " + args.compile_why
        elif left < 1:
            c.error = f"not run: the run's compile time ({args.compile_total:g} s, --compile-total) is spent"
        else:
            limit = min(args.compile_timeout, left)
            log(f"   compiling {c.name} (limit {limit:.0f} s) ...")
            compile_now(case, c, limit)
            args.compile_spent += c.extra["compile_s"]
            log(f"   ... {c.error or 'done'} in {c.extra['compile_s']} s")
    if any(c.kind == "compile" and "compile_s" in c.extra for c in configs):
        _stop_compile_workers()
    peaks: dict[str, int] = {}
    for c in configs:
        if c.error:
            continue
        try:
            peaks[c.name] = measure_memory(case, c, warmup=warmup)
        except Exception as e:
            c.error = f"failed: {type(e).__name__}: {str(e).strip()[:160]}"
            log(f"   {c.name}: {c.error}")
    ran = [c for c in configs if not c.error]
    log("   peaks: " + ", ".join(f"{c.name} {format_bytes(peaks[c.name])}" for c in ran))

    # remat's own compiled options, at the budgets whose peers compiled (NOTE [ Compiled blocks ]).
    budgets = [c.extra["activation_memory_budget"] for c in ran if c.kind == "compile"]
    try:
        prof = profile(case.model, case.batch, loss_fn=case.loss_fn, optimizer=case.optimizer,
                       repeats=args.profile_repeats, compile_budgets=budgets)
    except Exception as e:  # a compile failure is a result to report, not a crash
        if not budgets:
            raise
        log(f"   profile with compiled options failed ({type(e).__name__}: {str(e)[:160]}); without them")
        prof = profile(case.model, case.batch, loss_fn=case.loss_fn, optimizer=case.optimizer,
                       repeats=args.profile_repeats)
    if budgets:
        _stop_compile_workers()
    floor, dominant = smallest_any(prof)
    # remat's plans: one per peer peak, then below the lowest peer; identical plans measured once.
    plans: dict[tuple[Any, ...], Config] = {}
    for_budget: dict[str, Config | str] = {}  # peer name or "below k" -> remat config / why not
    budget_of: dict[str, int] = {}

    def plan_for(budget: int, label: str) -> None:
        budget_of[label] = budget
        try:
            plan = solve(prof, budget, method="optimal")
        except InfeasibleBudget as e:
            for_budget[label] = (f"infeasible: below remat's smallest feasible "
                                 f"{format_bytes(e.smallest_bytes)} ({e.dominant})")
            return
        key = (*plan.choices.values(), *(tuple(seg) for seg in plan.segments), plan.head)
        if key not in plans:
            plans[key] = remat_plan(case, plan, f"remat {summary(plan)}")
            plans[key].extra["budgets_bytes"] = []
        plans[key].extra["budgets_bytes"].append(budget)
        for_budget[label] = plans[key]

    for c in ran:
        plan_for(peaks[c.name], c.name)
    lowest = min(peaks.values())
    below: list[str] = []
    if floor < lowest:  # remat can go below every peer: budgets down to its floor
        for share in BELOW:
            label = f"below {len(below) + 1}"
            plan_for(floor + round(share * (lowest - floor)), label)
            below.append(label)
    remats = list(plans.values())
    # A plan that keeps every block applies nothing: it *is* the plain step, measured as such.
    same_as_plain = {c.name for c in remats
                     if c.plan and set(c.plan.choices.values()) == {"keep"} and not c.plan.segments
                     and c.plan.head in (None, HEAD_KEEP)}
    for c in remats:
        if c.name in same_as_plain:
            peaks[c.name] = peaks[configs[0].name]
            c.extra["same_as"] = configs[0].name
        else:
            peaks[c.name] = measure_memory(case, c, warmup=warmup)
    log(f"   remat: {len(remats)} distinct plans; smallest feasible {format_bytes(floor)}")

    timed = ran + [c for c in remats if c.name not in same_as_plain]
    times, walls = time_interleaved(case, timed, args.repeats, clock)
    for alias in same_as_plain:
        times[alias], walls[alias] = times[configs[0].name], walls[configs[0].name]
    base_ms = statistics.median(times[configs[0].name])

    rows = []
    for c in configs + remats:
        row: dict[str, Any] = {"name": c.name, "kind": c.kind, "status": c.error or "ok", **c.extra}
        if not c.error:
            row.update(peak_bytes=peaks[c.name], step_ms=statistics.median(times[c.name]),
                       overhead=statistics.median(times[c.name]) / base_ms - 1,
                       step_ms_all=times[c.name], wall_ms_all=walls[c.name])
        if c.plan is not None:
            row.update(choices=c.plan.choices, plan=summary(c.plan),
                       predicted_peak_bytes=c.plan.estimate.peak_bytes,
                       predicted_overhead=c.plan.estimate.overhead)
        rows.append(row)
    by_name = {r["name"]: r for r in rows}

    bar = [check_pair(case, args, clock, prof, configs[0], c, for_budget[c.name], by_name)
           for c in ran]
    below_rows = []
    for label in below:
        r = for_budget[label]
        entry: dict[str, Any] = {"label": label, "budget_bytes": budget_of[label]}
        if isinstance(r, str):
            entry.update(status=r)
        else:
            entry.update(status="ok", remat=r.name, **{k: by_name[r.name][k] for k in
                         ("peak_bytes", "overhead", "predicted_peak_bytes", "plan")})
            entry["fits"] = entry["peak_bytes"] <= entry["budget_bytes"]
        below_rows.append(entry)

    return {
        "schema_version": SCHEMA,
        "kind": "frontier-benchmark",
        "model": name,
        "title": case.title,
        "device": str(device),
        "dtype": str(args.dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "clock": args.clock,
        "repeats": args.repeats,
        "blocks": [b for b, _ in case.blocks],
        "batch_shape": _storages.batch_shape(case.batch),
        "plain": {"peak_bytes": peaks[configs[0].name], "step_ms": base_ms,
                  "wall_ms": statistics.median(walls[configs[0].name]),
                  "noise": _noise(times[configs[0].name])},
        "smallest_feasible_bytes": floor,
        "smallest_feasible_why": dominant,
        "configs": rows,
        "bar": bar,
        "below_peers": below_rows,
        "lowest_peer_bytes": lowest,
        "lowest_remat_bytes": min(peaks[c.name] for c in remats) if remats else None,
        "below_lowest_peer": bool(remats) and min(peaks[c.name] for c in remats) < lowest,
        "passed": (all(b["passed"] for b in bar) and all(b.get("fits", True) for b in below_rows)
                   and bool(remats) and min(peaks[c.name] for c in remats) < lowest),
        "elapsed_s": round(time.perf_counter() - t_start, 1),
    }


def check_pair(case: Case, args: argparse.Namespace, clock: Clock, prof: Profile, base: Config,
               peer: Config, remat: Config | str, rows: dict[str, dict[str, Any]]
               ) -> dict[str, Any]:
    """The bar for one peer: remat's plan at the peer's peak fits it and is no slower (2 points).

    A pair more than 2 points apart either way is timed again, the two alone, in turns, until the
    median's interval is on one side of the bar (NOTE [ Judging a pair ]), and judged on that
    rerun: the median over rounds of remat's step / the peer's step, in overhead points at the
    peer's overhead."""
    p = rows[peer.name]
    entry: dict[str, Any] = {"peer": peer.name, "peer_kind": peer.kind,
                             "budget_bytes": p["peak_bytes"], "peer_peak_bytes": p["peak_bytes"],
                             "peer_overhead": p["overhead"]}
    as_plan = peer.extra.get("as_plan")
    if as_plan:  # what remat's cost model says of the peer's own choice
        est = estimate(prof, as_plan)
        entry.update(peer_predicted_peak_bytes=est.peak_bytes, peer_predicted_overhead=est.overhead)
    if isinstance(remat, str):
        why = remat + _compile_why(p, prof, rows)
        if as_plan:
            why += (f"; remat's profile predicts the peer's own choice at "
                    f"{format_bytes(entry['peer_predicted_peak_bytes'])}, measured "
                    f"{format_bytes(p['peak_bytes'])}")
        entry.update(remat=None, passed=False, fits=False, rerun=None, why=why)
        return entry
    r = rows[remat.name]
    fits = r["peak_bytes"] <= p["peak_bytes"]
    entry.update(remat=remat.name, plan=r["plan"], remat_peak_bytes=r["peak_bytes"],
                 remat_predicted_peak_bytes=r["predicted_peak_bytes"],
                 remat_overhead=r["overhead"], fits=fits, rerun=None)
    diff = r["overhead"] - p["overhead"]
    same = r.get("same_as") == peer.name
    if abs(diff) > NOISE and not same:  # a win is confirmed like a loss
        log(f"   {remat.name} vs {peer.name}: {diff * 100:+.1f} points; timing the pair again")
        again: dict[str, list[float]] = {peer.name: [], remat.name: []}
        for _ in range(RERUN_BATCHES):  # NOTE [ Judging a pair ]
            batch, _ = time_interleaved(case, [peer, remat], 2 * args.repeats, clock)
            for name, ts in batch.items():
                again[name] += ts
            # Paired: each round's two steps ran back to back, so drift cancels in their ratio.
            ratios = [t / u for t, u in zip(again[remat.name], again[peer.name])]
            # A ratio becomes overhead points at the peer's overhead of the main run.
            low, high = ((x - 1) * (1 + p["overhead"]) for x in median_interval(ratios))
            if low > NOISE or high <= NOISE:
                break
        ratio = statistics.median(ratios)
        diff = (ratio - 1) * (1 + p["overhead"])
        entry["rerun"] = {"ratio": ratio, "difference": diff, "interval": [low, high],
                          "rounds": len(ratios), "peer_ms_all": again[peer.name],
                          "remat_ms_all": again[remat.name]}
    faster = diff <= NOISE
    entry.update(difference=diff, no_slower=faster, passed=fits and faster)
    reasons: list[str] = []
    if same:
        reasons.append("the same configuration (remat keeps every block)")
    if not fits:
        reasons.append(f"measured peak {format_bytes(r['peak_bytes'])} is over the budget by "
                   f"{format_bytes(r['peak_bytes'] - p['peak_bytes'])} (predicted "
                   f"{format_bytes(r['predicted_peak_bytes'])})")
    if not faster:
        reasons.append(f"{diff * 100:.1f} points slower than {peer.name}" + _compile_why(p, prof, rows)
                   + _loss_why(entry, peer, r))
    elif diff > 0 and not same:
        reasons.append("within the 2-point noise allowance")
    entry["why"] = "; ".join(reasons)
    return entry


def _loss_why(entry: dict[str, Any], peer: Config, r: dict[str, Any]) -> str:
    """Why remat's plan measured slower than an eager peer, from what the cost model said."""
    as_plan = peer.extra.get("as_plan")
    if peer.kind == "sequential":
        return (f": remat's plan {r['plan']} (brackets: segments) against checkpoint_sequential's "
                "segments of equal length; predicted "
                f"{_pct(r['predicted_overhead'])}")
    if not as_plan:
        return ""
    if list(as_plan.values()) == list(r["choices"].values()):
        return (": the same blocks recomputed; what differs is the checkpoint wrapper "
                "(remat's checkpoint vs torch.utils.checkpoint / transformers') or noise")
    ours = sum(o != "keep" for o in r["choices"].values())
    theirs = sum(o != "keep" for o in as_plan.values())
    if ours == theirs and abs(r["predicted_overhead"] - entry["peer_predicted_overhead"]) < 0.005:
        return (f": as many blocks recomputed ({ours}), other ones, predicted equally fast "
                f"({_pct(r['predicted_overhead'])}); what differs is the checkpoint wrapper or "
                "noise")
    if entry["peer_predicted_peak_bytes"] > entry["budget_bytes"]:
        return (f": remat's profile predicts the peer's own choice at "
                f"{format_bytes(entry['peer_predicted_peak_bytes'])}, over the "
                f"{format_bytes(entry['budget_bytes'])} it measures, so remat recomputes more")
    return (f": remat predicted its plan at {_pct(r['predicted_overhead'])} and the peer's at "
            f"{_pct(entry['peer_predicted_overhead'])}; its time estimate is off")


def _compile_why(peer_row: dict[str, Any], prof: Profile, rows: dict[str, dict[str, Any]]) -> str:
    if peer_row["kind"] != "compile":
        return ""
    text = ": torch.compile recomputes the ops its partitioner picks inside its fused kernels"
    full = rows.get("torch.compile budget 1", {})
    if full.get("status") == "ok" and peer_row["activation_memory_budget"] != 1:
        text += (f" (its step: {_pct(full['overhead'])} at budget 1, "
                 f"{_pct(peer_row['overhead'])} at {peer_row['activation_memory_budget']:g})")
    blocks = [b for b in prof.blocks if {"keep", "selective", "recompute"} <= b.options.keys()]
    if blocks:
        def med(option: str, what: str) -> float:
            return statistics.median(getattr(b.options[option], what) for b in blocks)

        text += (f"; remat's eager options per block: selective keeps "
                 f"{format_bytes(med('selective', 'kept_bytes'))} of "
                 f"{format_bytes(med('keep', 'kept_bytes'))} for "
                 f"+{med('selective', 'extra_ms'):.1f} ms, recompute "
                 f"{format_bytes(med('recompute', 'kept_bytes'))} for "
                 f"+{med('recompute', 'extra_ms'):.1f} ms")
        own = f"compiled:{peer_row['activation_memory_budget']:g}"
        if all(own in b.options for b in blocks):  # remat's own compiled option at that budget
            text += (f", {own} {format_bytes(med(own, 'kept_bytes'))} for "
                     f"{med(own, 'extra_ms'):+.1f} ms (timing noise between equal configurations "
                     "is this machine's)")
    return text


# --- reporting ----------------------------------------------------------------------------------


_CLOCKS = {"cpu": "process CPU time", "wall": "wall-clock"}


def _rerun_text(rerun: dict[str, Any]) -> str:
    """' (rerun n: [low, high])': the rerun's rounds and its median's 95% interval, in points."""
    if "interval" not in rerun:  # a result file written before the interval was kept
        return " (rerun)"
    low, high = rerun["interval"]
    return f" (rerun {rerun['rounds']}: [{low * 100:+.1f}, {high * 100:+.1f}])"


def _noise_text(noise: float) -> str:
    return "n/a (fewer than 4 steps)" if noise != noise else f"{noise * 100:.1f}%"


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{x * 100:+.1f}%"


def _mib(n: int | None) -> str:
    return "—" if n is None else format_bytes(n)


def model_markdown(res: dict[str, Any], env: str) -> str:
    plain_peak = res["plain"]["peak_bytes"]
    lines = [
        f"## {res['model']}: {res['title']}",
        "",
        f"{env}; {res['repeats']} interleaved timed steps per configuration (medians, "
        f"{_CLOCKS[res['clock']]}); plain step {res['plain']['step_ms']:.0f} ms "
        f"({res['plain']['wall_ms']:.0f} ms wall-clock), peak {format_bytes(plain_peak)}; "
        f"step-to-step noise (half IQR / median) {_noise_text(res['plain']['noise'])}. "
        "remat's smallest feasible peak: "
        f"{format_bytes(res['smallest_feasible_bytes'])} ({res['smallest_feasible_why']}).",
        "",
    ]
    table = []
    for r in res["configs"]:
        if r["status"] != "ok":
            table.append([r["name"], "—", "—", "—", "—", "—", r["status"]])
            continue
        note = ""
        if r["kind"] == "remat":
            note = "budgets " + ", ".join(format_bytes(b) for b in r["budgets_bytes"])
        elif r["kind"] == "compile":
            note = f"compiled in {r['compile_s']} s"
        table.append([r["name"], format_bytes(r["peak_bytes"]),
                      f"{r['peak_bytes'] / plain_peak * 100:.0f}%",
                      _mib(r.get("predicted_peak_bytes")), f"{r['step_ms']:.1f}",
                      _pct(r["overhead"]), note])
    lines.append(markdown_table(
        ["configuration", "peak", "of plain", "predicted peak", "step ms", "overhead", "note"],
        table, align=["left", "right", "right", "right", "right", "right", "left"]).rstrip("\n"))
    lines += ["", "remat plans: one letter per block (K keep, S selective, R recompute, O offload, "
              "B recompute+offload).", "", "### The bar: remat at each peer's peak", "",
              BAR_RULE, ""]
    lines.append(bar_table([(res["model"], b) for b in res["bar"]], with_model=False))
    if res["below_peers"]:
        lines += ["", "### Below every peer (remat only)", ""]
        lines.append(below_table([(res["model"], b) for b in res["below_peers"]], with_model=False))
    lines += ["", f"Lowest measured peak: remat {_mib(res.get('lowest_remat_bytes'))}, the peers "
              f"{_mib(res.get('lowest_peer_bytes'))} "
              f"({'below' if res.get('below_lowest_peer') else 'NOT below'})."]
    lines += ["", f"Bar {'passed' if res['passed'] else 'MISSED'} · {res['elapsed_s']:.0f} s", ""]
    return "\n".join(lines)


def bar_table(entries: list[tuple[str, dict[str, Any]]], *, with_model: bool) -> str:
    rows = []
    for model, b in entries:
        diff = "—"
        if b.get("difference") is not None:
            diff = f"{b['difference'] * 100:+.1f}" + (_rerun_text(b["rerun"]) if b.get("rerun") else "")
        row = [b["peer"], format_bytes(b["peer_peak_bytes"]), _pct(b["peer_overhead"]),
               _mib(b.get("remat_peak_bytes")), _pct(b.get("remat_overhead")), diff,
               b.get("plan") or "—", "✓" if b["passed"] else "✗", b.get("why") or ""]
        rows.append(([model] if with_model else []) + row)
    headers = ["peer", "peer peak = budget", "peer overhead", "remat peak", "remat overhead",
               "remat − peer (points)", "remat plan", "bar", "why"]
    align = ["left", "right", "right", "right", "right", "right", "left", "center", "left"]
    if with_model:
        headers, align = ["model", *headers], ["left", *align]
    return markdown_table(headers, rows, align=align).rstrip("\n")


def below_table(entries: list[tuple[str, dict[str, Any]]], *, with_model: bool) -> str:
    rows = []
    for model, b in entries:
        if b["status"] != "ok":
            row = [format_bytes(b["budget_bytes"]), "—", "—", "—", "—", b["status"]]
        else:
            row = [format_bytes(b["budget_bytes"]), format_bytes(b["peak_bytes"]),
                   _mib(b["predicted_peak_bytes"]), _pct(b["overhead"]), b["plan"],
                   "yes" if b["fits"] else
                   f"OVER by {format_bytes(b['peak_bytes'] - b['budget_bytes'])}"]
        rows.append(([model] if with_model else []) + row)
    headers = ["budget", "remat peak", "predicted peak", "remat overhead", "remat plan", "fits"]
    align = ["right", "right", "right", "right", "left", "left"]
    if with_model:
        headers, align = ["model", *headers], ["left", *align]
    return markdown_table(headers, rows, align=align).rstrip("\n")


def plot(res: dict[str, Any], path: Path) -> None:
    points = []
    for r in res["configs"]:
        if r["status"] != "ok":
            continue
        if r["kind"] == "remat":
            points.append(FrontierPoint(label=f"{format_bytes(r['peak_bytes'])}", method="optimal",
                                        peak_bytes=r["peak_bytes"], overhead=r["overhead"],
                                        predicted_peak_bytes=r["predicted_peak_bytes"]))
        else:
            points.append(FrontierPoint(label=r["name"], method=r["kind"],
                                        peak_bytes=r["peak_bytes"], overhead=r["overhead"]))
    plot_frontier(points, path=path, title=f"{res['model']}: {res['title']}")


def combined_markdown(results: list[dict[str, Any]], skipped: dict[str, str], env: str) -> str:
    lines = ["# remat vs PyTorch's own options: memory / step-time frontier", "",
             f"{env}. Generated by `benchmarks/frontier.py`; per-model tables, JSON and plots "
             "are next to this file.", "",
             BAR_RULE, ""]
    bars = [(res["model"], b) for res in results for b in res["bar"]]
    belows = [(res["model"], b) for res in results for b in res["below_peers"]]
    if bars:
        lines.append(bar_table(bars, with_model=True))
    if belows:
        lines += ["", "## Below every peer (remat only)", "", below_table(belows, with_model=True)]
    lines += ["", "## Summary", ""]
    for res in results:
        lost = [b for b in res["bar"] if not b["passed"]]
        won = len(res["bar"]) - len(lost)
        line = (f"- **{res['model']}** ({res['title']}): remat meets the bar at {won} of "
                f"{len(res['bar'])} peers; its lowest peak "
                f"{_mib(res.get('lowest_remat_bytes'))} is "
                f"{'below' if res.get('below_lowest_peer') else 'NOT below'} the lowest peer's "
                f"{_mib(res.get('lowest_peer_bytes'))}")
        if lost:
            line += "; misses it at " + "; ".join(f"{b['peer']} ({b['why']})" for b in lost)
        lines.append(line + f" · {res['elapsed_s']:.0f} s")
    for name, why in skipped.items():
        lines.append(f"- **{name}**: not run: {why}")
    return "\n".join(lines) + "\n"


# --- the command line ---------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(MODELS),
                    help=f"comma-separated, from {', '.join(MODELS)} (default: all)")
    ap.add_argument("--out", default="bench-out", help="output folder (default: bench-out)")
    ap.add_argument("--repeats", type=int, default=None,
                    help="timed steps per configuration (default 5; 2 with --quick)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--quick", action="store_true",
                    help="tiny models, 2 repeats, no torch.compile: a smoke test in seconds")
    ap.add_argument("--size", choices=["quick", "cpu", "gpu"], default=None,
                    help="model sizes (default: quick with --quick, gpu on cuda, else cpu)")
    ap.add_argument("--compile", default=None,
                    help="models whose torch.compile peers run: comma-separated, 'all' or 'none' "
                    "(default: none with --quick, gpt on cpu, all on cuda)")
    ap.add_argument("--compile-timeout", type=float, default=None,
                    help="seconds allowed per compile (default 240 on cpu, 120 on cuda)")
    ap.add_argument("--compile-total", type=float, default=None,
                    help="seconds of compiling for the whole run (default 600 on cpu, 150 on cuda)")
    ap.add_argument("--clock", choices=["cpu", "wall"], default=None,
                    help="step time: process CPU time or wall-clock (default: cpu on the CPU, "
                    "wall on cuda; NOTE [ CPU time on a shared CPU ])")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch.set_num_threads on cpu (default 1; see the README)")
    ap.add_argument("--strict", action="store_true", help="exit 1 when a model misses the bar")
    args = ap.parse_args(argv)
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in args.models if m not in MODELS]
    if unknown:
        ap.error(f"unknown model(s) {unknown}; expected some of {', '.join(MODELS)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda, but torch.cuda.is_available() is False on this machine")
    args.repeats = args.repeats or (2 if args.quick else 5)
    if args.repeats < 1:
        ap.error(f"--repeats must be >= 1, got {args.repeats}")
    args.size = args.size or ("quick" if args.quick else "gpu" if args.device == "cuda" else "cpu")
    args.dtype = torch.bfloat16 if args.size == "gpu" else torch.float32
    args.profile_repeats = 1 if args.quick else 3
    default_compile = "none" if args.quick else "all" if args.device == "cuda" else "gpt"
    spec = (args.compile or default_compile).strip()
    args.compile = (set(MODELS) if spec == "all" else set() if spec == "none"
                    else {m.strip() for m in spec.split(",")})
    args.compile_why = ("--quick skips torch.compile" if args.quick else
                        "CPU inductor compiles take minutes per budget here; the default run "
                        "compiles the gpt model only (--compile all for every model)")
    if args.compile_timeout is None:
        args.compile_timeout = 120.0 if args.device == "cuda" else 240.0
    if args.compile_total is None:
        args.compile_total = 150.0 if args.device == "cuda" else 600.0
    args.compile_spent = 0.0
    if args.clock is None:
        args.clock = "wall" if args.device == "cuda" else "cpu"
    if args.clock == "cpu" and args.device == "cuda":
        ap.error("--clock cpu measures nothing of a GPU's work; use --clock wall with --device cuda")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    if args.device == "cuda":
        where = f"cuda: {torch.cuda.get_device_name()}"
    else:
        where = (f"cpu ({platform.machine()}), {torch.get_num_threads()} torch thread(s) "
                 f"(torch.set_num_threads; {os.cpu_count()} cores, load average {load:.1f} at "
                 "start: a shared machine's timings are noisy)")
    env = f"{where}; torch {torch.__version__}; {str(args.dtype).removeprefix('torch.')}; AdamW"
    log(f"frontier benchmark: {', '.join(args.models)} -> {out}/\n{env}")
    t0 = time.perf_counter()
    results: list[dict[str, Any]] = []
    skipped: dict[str, str] = {}
    missing = transformers_missing()
    for name in args.models:
        if name in HF_MODELS and missing:
            skipped[name] = missing
            log(f"\n== {name}: skipped: {missing}")
            continue
        try:
            res = run_model(name, args)
        except Exception as e:
            traceback.print_exc()
            skipped[name] = f"failed: {type(e).__name__}: {str(e).strip()[:200]}"
            continue
        res["environment"] = env
        results.append(res)
        (out / f"{name}.json").write_text(json.dumps(res, indent=2) + "\n")
        md = model_markdown(res, env)
        (out / f"{name}.md").write_text(md)
        plot(res, out / f"{name}.png")
        log("\n" + md)
        # rewritten after every model, so that a run cut short still leaves its table
        (out / "README-table.md").write_text(combined_markdown(results, skipped, env))
    (out / "README-table.md").write_text(combined_markdown(results, skipped, env))
    log(f"\nwrote {out}/README-table.md · total {time.perf_counter() - t0:.0f} s")
    failed = [r["model"] for r in results if not r["passed"]]
    log("bar: " + ("passed for every model" if not failed else f"missed for {', '.join(failed)}"))
    return 1 if args.strict and (failed or skipped) else 0


if __name__ == "__main__":
    sys.exit(main())
