"""The benchmark scripts that need no trace or stack still run and end with their JSON line: a
bench that rots silently (a column the store's rows gained, say) is found here, not by a reader
of docs/results.md."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("script, args, keys", [
    ("cycle.py", ["--cycles", "1"], {"p50_ms", "p99_ms"}),
    ("snapshot_rows.py", ["--cycles", "1"], {"afresh_rows_ms", "reused_rows_ms", "reused_cycle_ms"}),
], ids=["one scheduling cycle at seed scale", "the store's rows turned into a snapshot"])
def test_a_benchmark_runs_and_ends_with_its_figures_as_json(script, args, keys):
    done = subprocess.run([sys.executable, str(ROOT / "bench" / script), *args], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    assert keys <= figures.keys(), figures


def chaos_bench():
    """bench/chaos.py as a module (benches are scripts, not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("chaos_bench", ROOT / "bench" / "chaos.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def life(job: str, gpus: list[str], first: float, last: float) -> dict:
    return {"job": job, "attempt": "1", "gpus": gpus, "first": first, "last": last}


@pytest.mark.parametrize("lives, found", [
    ([life("a", ["m0/0"], 0, 10), life("b", ["m0/0"], 10, 20)], 0),
    ([life("a", ["m0/0"], 0, 10), life("b", ["m0/1"], 5, 20)], 0),
    ([life("a", ["m0/0", "m0/1"], 0, 10), life("b", ["m0/1"], 9.5, 20)], 1),
    ([life("a", ["m0/0"], 0, 30), life("b", ["m0/0"], 5, 6), life("c", ["m0/0"], 20, 40)], 2),
    ([life("a", ["m0/0"], 0, 30), life("b", ["m0/0"], 31, 32), life("c", ["m0/0"], 1, 2)], 1),
], ids=["one after the other on a GPU", "side by side on two GPUs", "one GPU of a gang shared for half a second",
        "a long life overlapping two later ones", "a short one inside a long one, listed last"])
def test_the_chaos_bench_finds_every_pair_of_lives_that_held_one_gpu_at_once(lives, found):
    assert len(chaos_bench().overlaps(lives, "first", "last")) == found


def test_the_chaos_bench_freezes_a_process_with_every_process_under_it():
    shell = subprocess.Popen(["sh", "-c", "sleep 30 & sleep 30 & wait"], start_new_session=True)
    try:
        deadline = time.monotonic() + 5
        while len(tree := chaos_bench().process_tree(shell.pid)) < 3 and time.monotonic() < deadline:
            time.sleep(0.02)  # the children are being started
        assert tree[0] == shell.pid and len(tree) == 3
        assert all(Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"sleep") for pid in tree[1:])
    finally:
        os.killpg(shell.pid, signal.SIGKILL)  # the sleeps too
        shell.wait()
