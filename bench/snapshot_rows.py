"""Benchmark what a live cycle pays to turn its rows into the core's snapshot, and the cycle
after it, with the models built afresh every cycle or reused for rows that did not change.

    python bench/snapshot_rows.py [--cycles 20]

The rows are bench/cycle.py's seed-scale snapshot written out the way the store's queries
return them (640 machines, 606 running jobs, 2,000 queued jobs). Every cycle reads the same rows
again, as a live cycle a few seconds after the last one mostly does; `activities/rows.py`
(`Reuse`) then hands back last cycle's models, and the core's memories of the fleet's layout and
of each running job's GPUs keep serving. Afresh is what the live loop paid before. The last line
printed is one JSON object with the medians in milliseconds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from cycle import NOW, build_snapshot  # noqa: E402  (bench/cycle.py)

from activities import rows  # noqa: E402
from scheduler.cycle import run_cycle  # noqa: E402
from scheduler.gc_policy import no_collections  # noqa: E402
from scheduler.models import JobSpec, Snapshot  # noqa: E402


def request(spec: JobSpec) -> dict:
    return {**spec.model_dump(mode="json"), "command": ["python", "train.py"]}


def as_rows(snap: Snapshot) -> dict:
    """The snapshot as the store's SNAPSHOT_* queries would return it (activities/queries.py)."""
    machines = [
        {"id": m.id, "cluster": m.cluster, "block": m.block, "rack": m.rack, "gpu_type": m.gpu_type,
         "gpu_memory_gb": m.gpu_memory_gb, "partition": m.partition, "reachable": m.reachable,
         "takes_work": m.takes_work, "drain": m.drain, "gpus": m.gpus, "unhealthy": sorted(m.unhealthy_gpus)}
        for m in snap.machines
    ]
    running = [
        {"allocation_id": k, "job_id": r.spec.job_id, "gpus": [f"{m}/{g}" for m, g in r.gpus],
         "placed_at": r.started_at, "started_at": r.started_at, "progress_at_start": r.progress_at_start,
         "checkpoint_phase": r.checkpoint_phase, "draining_until": r.draining_until,
         "preempted_for": r.preempted_for, "state": "draining" if r.draining else "running",
         "last_checkpoint_at": r.last_checkpoint_at, "request": request(r.spec),
         "submit_time": r.submit_time, "preemptions": list(r.preemptions), "priority": r.spec.priority.value}
        for k, r in enumerate(snap.running, start=1)
    ]
    queue = [
        {"id": q.spec.job_id, "request": request(q.spec), "priority": q.spec.priority.value,
         "submit_time": q.submit_time, "queued_since": q.queued_since, "progress": q.progress,
         "preemptions": list(q.preemptions)}
        for q in snap.queue
    ]
    quotas = [{"team": team, "guaranteed": q.guaranteed, "max_gpus": q.max, "queue_cap": q.queue_cap}
              for team, q in snap.quotas.items()]
    lock = {"earmarks": json.dumps([e.model_dump(mode="json") for e in snap.earmarks]), "policy": "{}"}
    return {"machines": machines, "running": running, "queue": queue, "quotas": quotas, "lock": lock}


def timed(cycles: int, table: dict, reuse: rows.Reuse | None, step: float) -> tuple[list[float], list[float]]:
    read_ms, cycle_ms = [], []
    for k in range(cycles):
        with no_collections():  # as the store holds it, from the read to the commit (Store.plan_cycle)
            t0 = time.perf_counter()
            snap = rows.snapshot(cluster="c1", now=NOW + k * step, lock=table["lock"],
                                 config=rows.policy(table["lock"]), machines=table["machines"],
                                 running=table["running"], queue=table["queue"], quotas=table["quotas"],
                                 reuse=reuse)
            t1 = time.perf_counter()
            run_cycle(snap)
            t2 = time.perf_counter()
        read_ms.append((t1 - t0) * 1000.0)
        cycle_ms.append((t2 - t1) * 1000.0)
    return read_ms, cycle_ms


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=20, help="timed cycles of each kind (default 20)")
    args = parser.parse_args(argv)
    if args.cycles < 1:
        parser.error("--cycles must be at least 1")
    step = 3.0
    table = as_rows(build_snapshot(1, span=(2 * args.cycles + 2) * step))
    figures = {}
    for name, reuse in (("afresh", None), ("reused", rows.Reuse())):
        timed(2, table, reuse, step)  # warm-up: the reused kind builds its models here
        read_ms, cycle_ms = timed(args.cycles, table, reuse, step)
        figures[f"{name}_rows_ms"] = round(statistics.median(read_ms), 1)
        figures[f"{name}_cycle_ms"] = round(statistics.median(cycle_ms), 1)
        print(f"{name}: rows to snapshot {figures[f'{name}_rows_ms']} ms, then the cycle "
              f"{figures[f'{name}_cycle_ms']} ms (medians of {args.cycles})")
    figures.update(cycles=args.cycles, machines=len(table["machines"]), running=len(table["running"]),
                   queued=len(table["queue"]))
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
