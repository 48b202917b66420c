#!/usr/bin/env python3
"""Benchmark: replay consecutive cycles of a simulation, to compare builds without timing noise.

    python bench/replay.py capture --trace T.csv --fleet F.yaml --from 144000 --to 180000 --out out/replay.pkl
    python bench/replay.py run --snapshots out/replay.pkl [--first N]
    python bench/replay.py spans --trace T.csv --fleet F.yaml [--hours 6]
    valgrind --tool=callgrind --callgrind-out-file=/dev/null \\
        python bench/replay.py run --snapshots out/replay.pkl --first 100     # instruction count

`capture` simulates the trace with gpusched's policy and keeps every cycle's snapshot between two
trace times (seconds), in one pickle, so running jobs shared by consecutive snapshots stay the
same objects, as the simulator and the live store hand them to the core. `run` calls `run_cycle`
on each of them in order, as the simulator's loop does (the collector held back), and prints
the wall time and a digest of every decision and estimate: two builds that decide alike print
the same digest. `spans` simulates the whole trace and prints, per span of trace time, how long its
cycles took, how many there were and the mean running jobs and queue: where a window worth
capturing is.

Timings on a shared 2-core machine move by 30% from one minute to the next, more than most
changes save. Under valgrind's callgrind the instructions a replay executes are counted instead,
and they do not move: run it with `--first 0` too and subtract, to leave out the start-up. This is
a benchmark, not a test; its last line is one JSON object.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import pickle
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from scheduler.cycle import run_cycle  # noqa: E402
from scheduler.gc_policy import few_collections  # noqa: E402
from scheduler.models import Snapshot  # noqa: E402
from scheduler.sim.engine import Simulation, SimSettings  # noqa: E402
from workers.cli import load_inputs  # noqa: E402


class _Done(Exception):
    """The capture window is over: the simulation need not go on."""


class Capture(Simulation):
    """The simulation, keeping the snapshots of the cycles between two trace times."""

    def __init__(self, *args, start: float, end: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.start_at, self.end_at = start, end
        self.kept: list[Snapshot] = []

    def snapshot(self, cluster, now):
        if now > self.end_at:
            raise _Done
        snap = super().snapshot(cluster, now)
        if now >= self.start_at:
            self.kept.append(snap)
        return snap


def capture(args: argparse.Namespace) -> dict:
    trace, fleet = load_inputs(args.trace, args.fleet)
    sim = Capture(trace, fleet, "gpusched", SimSettings(), start=args.start, end=args.end)
    try:
        sim.run()
    except _Done:
        pass
    with open(args.out, "wb") as f:
        pickle.dump(sim.kept, f, protocol=pickle.HIGHEST_PROTOCOL)
    return {"snapshots": len(sim.kept), "from": args.start, "to": args.end, "out": args.out}


def replay(args: argparse.Namespace) -> dict:
    with open(args.snapshots, "rb") as f:
        snapshots: list[Snapshot] = pickle.load(f)
    if args.first is not None:
        snapshots = snapshots[:args.first]
    digest = hashlib.sha256()
    gc.collect()
    gc.freeze()  # the snapshots are loaded: set them aside, as the simulator does its trace
    with few_collections():
        began = time.perf_counter()
        for snap in snapshots:
            result = run_cycle(snap)
            digest.update(repr((result.placements, result.preemptions, result.requeues, result.earmarks,
                                [(p.job_id, p.estimated_start, p.reason) for p in result.pending],
                                result.next_wake)).encode())
        elapsed = time.perf_counter() - began
    cycles = len(snapshots)
    print(f"{cycles} cycles in {elapsed:.2f} s ({1000 * elapsed / max(cycles, 1):.2f} ms a cycle), "
          f"digest {digest.hexdigest()[:16]}")
    return {"cycles": cycles, "seconds": round(elapsed, 3), "digest": digest.hexdigest()[:16]}


class Spans(Simulation):
    """The simulation, timing its cycles by span of trace time."""

    def __init__(self, *args, span: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.span = span
        self.by_span: dict[int, list[float]] = {}  # span -> [seconds, cycles, running, queued]

    def run_cycle(self, cluster, now):
        began = time.perf_counter()
        super().run_cycle(cluster, now)
        entry = self.by_span.setdefault(int(now // self.span), [0.0, 0, 0, 0])
        entry[0] += time.perf_counter() - began
        entry[1] += 1
        entry[2] += len(cluster.running)
        entry[3] += len(cluster.queue)


def spans(args: argparse.Namespace) -> dict:
    trace, fleet = load_inputs(args.trace, args.fleet)
    sim = Spans(trace, fleet, "gpusched", SimSettings(), span=args.hours * 3600.0)
    began = time.perf_counter()
    sim.run()
    total = time.perf_counter() - began
    rows = []
    for k, (seconds, cycles, running, queued) in sorted(sim.by_span.items()):
        start = k * args.hours
        rows.append({"from_h": start, "seconds": round(seconds, 2), "cycles": cycles,
                     "ms_per_cycle": round(1000 * seconds / cycles, 1),
                     "running": running // cycles, "queued": queued // cycles})
        print(f"{start:5g}-{start + args.hours:g} h: {seconds:6.1f} s in {cycles:5d} cycles "
              f"({1000 * seconds / cycles:5.1f} ms each), running {running // cycles}, queued {queued // cycles}")
    print(f"{total:.1f} s in all, {sum(r['seconds'] for r in rows):.1f} s of it in cycles")
    return {"seconds": round(total, 2), "spans": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    cap = sub.add_parser("capture", help="simulate and keep the snapshots of a window of cycles")
    cap.add_argument("--trace", required=True)
    cap.add_argument("--fleet", required=True)
    cap.add_argument("--from", dest="start", type=float, required=True, help="trace time, seconds")
    cap.add_argument("--to", dest="end", type=float, required=True, help="trace time, seconds")
    cap.add_argument("--out", required=True, help="pickle to write")
    run = sub.add_parser("run", help="run the cycle on captured snapshots, in order")
    run.add_argument("--snapshots", required=True, help="a pickle written by capture")
    run.add_argument("--first", type=int, default=None, help="only the first N snapshots")
    spn = sub.add_parser("spans", help="simulate and time the cycles by span of trace time")
    spn.add_argument("--trace", required=True)
    spn.add_argument("--fleet", required=True)
    spn.add_argument("--hours", type=float, default=6.0, help="length of a span (default 6)")
    args = parser.parse_args(argv)
    commands = {"capture": capture, "run": replay, "spans": spans}
    print(json.dumps(commands[args.command](args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
