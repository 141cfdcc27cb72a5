"""benchmarks/frontier.py runs end to end and writes what it promises.

Timings are the benchmark's business, not the tests' (STYLE: deterministic checks in CI, timings in
benchmarks): nothing here looks at a step time or an overhead, only at files, keys and bytes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "frontier.py"

CONFIG_KEYS = {"name", "kind", "status"}
MEASURED_KEYS = {"peak_bytes", "step_ms", "overhead", "step_ms_all"}
BAR_KEYS = {"peer", "peer_kind", "budget_bytes", "peer_peak_bytes", "peer_overhead", "remat",
            "fits", "passed", "why"}


@pytest.mark.slow
def test_quick_frontier_writes_tables_json_and_plot(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--models", "gpt", "--repeats", "1",
         "--out", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for name in ("gpt.md", "gpt.json", "gpt.png", "README-table.md"):
        assert (out / name).is_file(), f"{name} missing; wrote {sorted(p.name for p in out.iterdir())}"
    assert (out / "gpt.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    res = json.loads((out / "gpt.json").read_text())
    assert res["schema_version"] == 1 and res["kind"] == "frontier-benchmark"
    assert res["model"] == "gpt" and res["device"] == "cpu"
    for key in ("title", "threads", "repeats", "blocks", "batch_shape", "smallest_feasible_bytes",
                "configs", "bar", "below_peers", "passed", "elapsed_s"):
        assert key in res, key
    assert {"peak_bytes", "step_ms"} <= res["plain"].keys()

    configs = {c["name"]: c for c in res["configs"]}
    for c in res["configs"]:
        assert c.keys() >= CONFIG_KEYS, c
        if c["status"] == "ok":
            assert c.keys() >= MEASURED_KEYS, c
    # Every eager peer ran; --quick skips torch.compile and says so.
    for name in ("no checkpointing", "every block", "every 2nd block", "every 3rd block"):
        assert configs[name]["status"] == "ok", configs[name]
    assert any(n.startswith("checkpoint_sequential") and c["status"] == "ok" for n, c in configs.items())
    compile_rows = [c for c in res["configs"] if c["kind"] == "compile"]
    assert len(compile_rows) == 3 and all(c["status"].startswith("not run") for c in compile_rows)
    remats = [c for c in res["configs"] if c["kind"] == "remat"]
    assert remats and all({"choices", "plan", "predicted_peak_bytes"} <= c.keys() for c in remats)

    # One bar entry per peer that ran, its budget the peer's own measured peak.
    ran = [c for c in res["configs"] if c["kind"] != "remat" and c["status"] == "ok"]
    assert [b["peer"] for b in res["bar"]] == [c["name"] for c in ran]
    for b in res["bar"]:
        assert b.keys() >= BAR_KEYS, b
        assert b["budget_bytes"] == configs[b["peer"]]["peak_bytes"]
        if b["remat"] is not None:
            assert b["remat_peak_bytes"] == configs[b["remat"]]["peak_bytes"]
            assert b["fits"] == (b["remat_peak_bytes"] <= b["budget_bytes"])
        if b.get("rerun"):  # judged on the rerun's median, inside its interval (NOTE [ Judging a pair ])
            low, high = b["rerun"]["interval"]
            assert low <= b["difference"] == b["rerun"]["difference"] <= high, b["rerun"]
            assert b["rerun"]["rounds"] in (2, 4, 6, 8), b["rerun"]["rounds"]  # batches of 2 x 1 round

    table = (out / "README-table.md").read_text()
    assert "| gpt" in table and "remat plan" in table


def test_median_interval_covers_the_median_about_95_percent_of_the_time() -> None:
    """The rerun's stopping rule rests on this interval: too narrow would call noise a result,
    too wide would rerun every pair to the cap."""
    import random

    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from frontier import median_interval
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    rng = random.Random(0)
    for n in (10, 20, 40, 80):
        draws = [[rng.lognormvariate(0, 0.5) for _ in range(n)] for _ in range(2000)]
        covered = sum(lo <= 1.0 <= hi for lo, hi in map(median_interval, draws)) / len(draws)
        assert 0.94 <= covered <= 0.995, (n, covered)  # the median of lognormal(0, s) is 1
        if n >= 40:  # not the whole range: the extremes are outside it
            lo, hi = median_interval(draws[0])
            assert min(draws[0]) < lo and hi < max(draws[0])
