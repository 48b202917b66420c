"""The benchmark scripts that need no trace or stack still run and end with their JSON line: a
bench that rots silently (a column the store's rows gained, say) is found here, not by a reader
of docs/results.md."""

from __future__ import annotations

import json
import subprocess
import sys
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
