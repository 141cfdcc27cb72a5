"""What the CPU record of a step costs in host memory (NOTE [ The CPU record's own memory ] in
remat.measure.cpu_record).

Each configuration runs in its own process (glibc keeps what a process freed, so one run would
inherit the last one's heap; a record's first use in a process costs the most): the model is
built, one step warms it up, then one step runs with nothing recording it, under ``torch.profiler`` with ``profile_memory=True`` (Kineto; its events
read as remat read them before), or under remat's ``MemoryTracer`` without and with the kernels'
scratch. The columns are the record's own memory: the process's resident high-water mark over the
step (the record read included), and the most address space it mapped (what a capped process
runs out of), each minus the same step's with nothing recording it. MemoryTracer marks each
block's forward start and end, as the profiler's steps do (where its record may be cut). Each record
holds the step's allocations and frees (one memory event each) and more besides: torch.profiler
every op and autograd node, MemoryTracer its marks, and with the kernels' scratch every op. ``MALLOC_MMAP_THRESHOLD_`` and ``MALLOC_ARENA_MAX`` as in the capped tests.

    python benchmarks/record_cost.py [--out bench-out/record_cost.md]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

WAYS = ("nothing", "torch.profiler", "MemoryTracer", "MemoryTracer(kernels=True)")
MODELS = ("gpt (4 blocks)", "gpt (32 blocks)", "unet (12 blocks)")


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def _child(model_name: str, way: str) -> dict[str, Any]:
    """One configuration, in this process: the record's events and the step's high-water mark."""
    import torch
    from profile_cost import _models  # the same models, built alike (this folder is on sys.path)

    from remat.manual.blocks import find_blocks
    from remat.measure import step as _step
    from remat.measure.tracer import MemoryTracer

    torch.set_num_threads(1)
    model, batch, loss_fn = _models()[model_name]()
    fn = _step.resolve_loss_fn(loss_fn)

    def step() -> None:
        _step.forward_loss(model, batch, fn).backward()
        model.zero_grad(set_to_none=True)

    step()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM from here
    rss, size = _status("VmRSS"), _status("VmSize")
    highest = [size]
    done = threading.Event()

    def sample() -> None:  # VmPeak cannot be reset: the address space is sampled
        while not done.wait(0.001):
            highest.append(_status("VmSize"))

    sampler = threading.Thread(target=sample)
    sampler.start()
    events = 0
    if way == "nothing":
        step()
    elif way == "torch.profiler":
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
            step()
        events = sum(e.name() == "[memory]" for e in prof.profiler.kineto_results.events())
    else:
        with MemoryTracer("cpu", kernels=way.endswith("(kernels=True)")) as tracer:
            marks = [h for _, block in find_blocks(model) for h in (
                block.register_forward_pre_hook(lambda *_: tracer.mark("start")),
                block.register_forward_hook(lambda *_: tracer.mark("end")))]
            step()
            for h in marks:
                h.remove()
        events = len(tracer.trace.points)
    highest.append(_status("VmSize"))
    done.set()
    sampler.join()
    return {"resident_bytes": _status("VmHWM") - rss, "mapped_bytes": max(highest) - size, "events": events}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("bench-out/record_cost.md"))
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_child(*args.child)))
        return
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_ARENA_MAX": "1"}
    rows = ["| model | record | memory events | resident | mapped |", "|---|---|--:|--:|--:|"]
    for model_name in MODELS:
        runs = {}
        for way in WAYS:
            proc = subprocess.run([sys.executable, __file__, "--child", model_name, way], env=env,
                                  capture_output=True, text=True, check=True)
            runs[way] = json.loads(proc.stdout.strip().splitlines()[-1])
        for way in WAYS[1:]:
            resident, mapped = ((runs[way][k] - runs["nothing"][k]) / 2**20 for k in ("resident_bytes", "mapped_bytes"))
            rows.append(f"| {model_name} | {way} | {runs[way]['events']:,} | {resident:.1f} MiB | {mapped:.1f} MiB |")
        print("\n".join(rows[-3:]), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(__doc__.split("\n\n")[0] + "\n\n" + "\n".join(rows) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
