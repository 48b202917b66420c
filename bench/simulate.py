#!/usr/bin/env python3
"""Benchmark: the seed-scale simulation, gpusched against strict FIFO and EASY backfill.

    python bench/simulate.py [--out DIR] [--jobs N] [--days D] [--gpus G] [--load L] [--seed S]
                             [--fleet F.yaml] [--compare fifo,easy]

It runs the real command line, as a user would: ``gpusched trace generate`` writes a synthetic
trace (by default 3,000 jobs over 3 days, load 1.2 on 5,120 GPUs, seed 1) into a temporary
folder, then ``gpusched simulate --trace … --fleet examples/fleet-seed.yaml --compare fifo,easy
--out DIR`` replays it. The comparison table goes to stdout as the CLI prints it; the last line
is one JSON object with each policy's simulation wall time (from the CLI's stderr lines
``<policy>: N jobs simulated in X s``) and the headline metrics of each policy's summary.json.

For a quick try: ``--jobs 200 --days 1 --gpus 256 --fleet examples/fleet-small.yaml``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SIMULATED = re.compile(r"^(?P<policy>[\w.-]+): (?P<jobs>\d+) jobs simulated in (?P<wall>[0-9.]+) s")
CLASSES = ("critical", "high", "normal", "low", "all")


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def gpusched(*args: str, echo: bool = False) -> subprocess.CompletedProcess:
    """Run the CLI from this checkout (``python -m workers.cli``), capturing its output.

    With ``echo``, each stderr line is also shown as it comes (a seed-scale run takes minutes, and
    the CLI reports each policy as it finishes). The child never outlives this script."""
    with tempfile.TemporaryFile("w+") as stdout:
        proc = subprocess.Popen([sys.executable, "-m", "workers.cli", *args], cwd=ROOT, env=_env(),
                                stdout=stdout, stderr=subprocess.PIPE, text=True)
        try:
            lines = []
            for line in proc.stderr:
                lines.append(line)
                if echo:
                    print(line, end="", file=sys.stderr, flush=True)
            proc.wait()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        stdout.seek(0)
        return subprocess.CompletedProcess(proc.args, proc.returncode, stdout.read(), "".join(lines))


def dig(data, *path):
    """data[path[0]][path[1]]…, or None where any step is missing."""
    for key in path:
        if not isinstance(data, dict) or key not in data:
            return None
        data = data[key]
    return data


def headline(summary: dict) -> dict:
    return {
        "utilisation_while_waiting": dig(summary, "utilisation_while_waiting"),
        "utilisation": dig(summary, "utilisation"),
        "wait_p95_s": {c: dig(summary, "wait_s", c, "p95") for c in CLASSES},
        "never_started": dig(summary, "wait_s", "all", "never_started"),
        "work_lost_fraction": dig(summary, "work_lost_fraction"),
        "eta_median_relative_error": dig(summary, "eta_error", "median_relative_error"),
        "reclaim_latency_p95_s": dig(summary, "reclaim_latency_s", "p95"),
        "cycle_ms_p99": dig(summary, "cycle_ms", "p99"),
        "double_booked_gpus": dig(summary, "double_booked_gpus"),
        "simulation_wall_s": dig(summary, "simulation_wall_s"),  # 0.01 s resolution; stderr's is 0.1 s
        "jobs": dig(summary, "jobs"),
    }


def fail(step: str, done: subprocess.CompletedProcess, echoed: bool = False) -> int:
    sys.stderr.write(done.stdout)
    if not echoed:
        sys.stderr.write(done.stderr)
    print(f"bench/simulate.py: `gpusched {step}` exited {done.returncode}", file=sys.stderr)
    return done.returncode or 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="out/bench-seed", help="output folder (default out/bench-seed)")
    parser.add_argument("--jobs", type=int, default=3000, help="jobs in the trace (default 3000)")
    parser.add_argument("--days", type=float, default=3.0, help="arrival window in days (default 3)")
    parser.add_argument("--gpus", type=int, default=5120, help="GPUs the load is measured against (default 5120)")
    parser.add_argument("--load", type=float, default=1.2, help="offered load (default 1.2)")
    parser.add_argument("--seed", type=int, default=1, help="trace seed (default 1)")
    parser.add_argument("--fleet", default="examples/fleet-seed.yaml",
                        help="fleet YAML (default examples/fleet-seed.yaml)")
    parser.add_argument("--compare", default="fifo,easy", help="baselines to compare with (default fifo,easy)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    if not out.is_absolute():
        out = ROOT / out

    with tempfile.TemporaryDirectory(prefix="gpusched-bench-") as tmp:
        trace = Path(tmp) / "trace.csv"
        done = gpusched("trace", "generate", "--out", str(trace), "--jobs", str(args.jobs),
                        "--days", str(args.days), "--gpus", str(args.gpus), "--load", str(args.load),
                        "--seed", str(args.seed))
        if done.returncode != 0:
            return fail("trace generate", done)
        began = time.perf_counter()
        print(f"simulating {args.jobs} jobs with gpusched and {args.compare} (a seed-scale run takes minutes)",
              file=sys.stderr, flush=True)
        done = gpusched("simulate", "--trace", str(trace), "--fleet", args.fleet,
                        "--compare", args.compare, "--out", str(out), echo=True)
        total_wall = time.perf_counter() - began
    if done.returncode != 0:
        return fail("simulate", done, echoed=True)

    print(done.stdout.rstrip())
    wall: dict[str, float] = {}
    jobs = None
    for line in done.stderr.splitlines():
        found = SIMULATED.match(line.strip())
        if found:
            wall[found["policy"]] = float(found["wall"])
            jobs = int(found["jobs"])
    if not wall:
        print("bench/simulate.py: no '<policy>: N jobs simulated in X s' line on the CLI's stderr",
              file=sys.stderr)
        return 1

    policies = list(wall)  # the CLI's order: the chosen policy first, then the baselines
    summaries = {}
    for k, name in enumerate(policies):
        path = out / "summary.json" if k == 0 else out / name / "summary.json"
        summaries[name] = headline(json.loads(path.read_text()))
    main_policy = policies[0]
    result = {
        "jobs": jobs,
        "wall_s": wall,
        "total_wall_s": round(total_wall, 2),
        "policy": main_policy,
        **{k: v for k, v in summaries[main_policy].items() if k != "jobs"},
        "policies": summaries,
        "out": os.path.relpath(out, ROOT),
        "trace": {"jobs": args.jobs, "days": args.days, "gpus": args.gpus, "load": args.load, "seed": args.seed},
        "fleet": args.fleet,
    }
    print(f"results in {result['out']}/ (comparison.md, summary.json, run.png; baselines in <policy>/)")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
