"""Benchmark the live stack on the embedded servers: how fast freed GPUs go to the next job, and
how many complete job lifecycles per second the stack sustains.

    python bench/lifecycle.py [--handoffs 40] [--jobs 300] [--agents 8] [--concurrency 16]

1. Hand-off latency: one machine of 4 GPUs and a chain of jobs that each need all 4. For each job
   after the first: from its predecessor's GPUs freeing (the allocation's end in Postgres) to its
   own process starting on the agent (the time the process prints first).
2. Throughput: ``--agents`` machines of 8 GPUs, ``--jobs`` one-GPU jobs that exit at once,
   submitted by ``--concurrency`` concurrent clients; complete lifecycles (submit → admitted →
   placed → launched → exited → released → succeeded) per second, first submit to last success.

The stack is started in a temporary folder and stopped at the end. The last line printed is one
JSON object with the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scheduler.models import Quota  # noqa: E402
from scheduler.sim.report import percentile  # noqa: E402
from workers import devstack  # noqa: E402
from workers.client import GpuschedClient  # noqa: E402
from workflows.types import JobRequest  # noqa: E402

STAMP = "import time; print('RAN', time.time(), flush=True); time.sleep(float(__import__('sys').argv[1]))"


async def handoffs(client: GpuschedClient, data_dir: Path, count: int) -> dict:
    ids = [f"handoff-{i:03d}" for i in range(count + 1)]  # count hand-offs take one job more
    for job_id in ids:
        await client.submit(JobRequest(job_id=job_id, team="bench", num_gpus=4, cluster="c1",
                                       command=[sys.executable, "-c", STAMP, "0.3"]))
    for job_id in ids:
        await client.wait(job_id, timeout=600)
    latencies = []
    for before, after in zip(ids, ids[1:]):
        freed = (await client.store.pool.fetchval(
            "SELECT ended_at FROM allocations WHERE job_id = $1 ORDER BY attempt DESC LIMIT 1", before))
        log = next(data_dir.glob(f"jobs/*/{after}/attempt-1.log")).read_text()
        started = float(next(line.split()[1] for line in log.splitlines() if line.startswith("RAN")))
        latencies.append(started - freed)
    return {"handoffs": len(latencies), "handoff_p50_s": round(percentile(latencies, 50), 3),
            "handoff_p95_s": round(percentile(latencies, 95), 3), "handoff_max_s": round(max(latencies), 3)}


async def throughput(client: GpuschedClient, jobs: int, concurrency: int) -> dict:
    gate = asyncio.Semaphore(concurrency)

    async def one(i: int) -> None:
        async with gate:
            await client.submit(JobRequest(job_id=f"tp-{i:05d}", team="bench", num_gpus=1, cluster="c1",
                                           expected_duration=1, command=["true"]))
    began = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(jobs)))
    submitted = time.perf_counter() - began
    views = await asyncio.gather(*(client.wait(f"tp-{i:05d}", timeout=1200) for i in range(jobs)))
    elapsed = time.perf_counter() - began
    failed = [v.job_id for v in views if v.state != "succeeded"]
    return {"jobs": jobs, "succeeded": jobs - len(failed), "submit_s": round(submitted, 1),
            "elapsed_s": round(elapsed, 1), "lifecycles_per_s": round(jobs / elapsed, 2)}


def on_stack(data_dir: Path, machines: int, gpus: int, body) -> dict:
    """Run ``body(client)`` on a fresh embedded stack (its own servers), then stop the stack,
    also what a failed start left running."""
    try:
        up = devstack.up(data_dir, machines=machines, gpus_per_machine=gpus, ui=False, fast=True)

        async def run() -> dict:
            async with await GpuschedClient.connect(up.settings) as client:
                await client.set_quota("bench", Quota(guaranteed=0))
                return await body(client)

        return asyncio.run(run())
    finally:
        devstack.down(data_dir)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--handoffs", type=int, default=40)
    parser.add_argument("--jobs", type=int, default=300)
    parser.add_argument("--agents", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=16)
    args = parser.parse_args()
    figures: dict = {}
    with tempfile.TemporaryDirectory(prefix="gpusched-bench-") as tmp:
        first = Path(tmp) / "handoffs"
        figures.update(on_stack(first, 1, 4, lambda c: handoffs(c, first, args.handoffs)))
        figures.update(on_stack(Path(tmp) / "throughput", args.agents, 8,
                                lambda c: throughput(c, args.jobs, args.concurrency)))
    for key, value in figures.items():
        print(f"{key:>20}: {value}", file=sys.stderr)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
