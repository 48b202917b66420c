"""Benchmark preemption on the embedded stack: from the scheduler's preempt decision to the
preempted job's process running again elsewhere, the grace period the job used excluded.

    python bench/preemption.py [--rounds 10]

Each round, on 2 machines × 4 GPUs: a low-priority victim and a normal blocker fill the cluster; a
critical job arrives and the scheduler preempts the victim; the blocker is cancelled at the same
moment, so a machine frees elsewhere. The victim traps SIGTERM, "checkpoints" for 0.5 s and
exits; it is requeued and placed on the freed machine. Measured per round:

    resume latency = (victim's attempt 2 process start − the preempt decision in Postgres)
                     − (victim's exit − its SIGTERM)             [the grace it used]

The last line printed is one JSON object with p50/p95/max.
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

from bench.lifecycle import on_stack  # noqa: E402
from scheduler.sim.report import percentile  # noqa: E402
from scheduler.models import Priority  # noqa: E402
from workers.client import GpuschedClient  # noqa: E402
from workflows.types import JobRequest  # noqa: E402

VICTIM = ("import signal, sys, time\n"
          "print('RAN', time.time(), flush=True)\n"
          "def stop(*_):\n"
          "    print('SIGTERM', time.time(), flush=True)\n"
          "    time.sleep(0.5)  # writing a checkpoint\n"
          "    print('EXIT', time.time(), flush=True)\n"
          "    sys.exit(0)\n"
          "signal.signal(signal.SIGTERM, stop)\n"
          "while True:\n"
          "    time.sleep(0.1)\n")


def stamp(log: str, word: str) -> float:
    for line in log.splitlines():
        if line.startswith(word):
            return float(line.split()[1])
    raise RuntimeError(f"no {word} line in the job's log:\n{log}")


async def rounds(client: GpuschedClient, data_dir: Path, count: int) -> dict:
    await client.store.configure_cluster("c1", policy={"min_runtime": 0, "grace_period": 10})

    async def running(job_id: str, attempt: int = 1) -> None:
        while True:
            view = await client.status(job_id)
            if len(view.attempts) >= attempt and view.attempts[attempt - 1].started_at and view.state == "running":
                return
            await asyncio.sleep(0.05)

    def log_of(job_id: str, attempt: int) -> str:
        for _ in range(100):
            logs = list(data_dir.glob(f"jobs/*/{job_id}/attempt-{attempt}.log"))
            if logs and "\nRAN " in logs[0].read_text():
                return logs[0].read_text()
            time.sleep(0.05)
        raise RuntimeError(f"no log for {job_id} attempt {attempt}")

    latencies = []
    for i in range(count):
        blocker, victim, critical = f"blocker-{i}", f"victim-{i}", f"critical-{i}"
        await client.submit(JobRequest(job_id=blocker, team="bench", num_gpus=4, command=["sleep", "600"]))
        await client.submit(JobRequest(job_id=victim, team="bench", num_gpus=4, priority=Priority.low,
                                       checkpoint_interval=60, command=[sys.executable, "-c", VICTIM]))
        await running(blocker)
        await running(victim)
        await client.submit(JobRequest(job_id=critical, team="bench", num_gpus=4, priority=Priority.critical,
                                       command=["sleep", "2"]))
        await client.cancel(blocker)
        await running(victim, attempt=2)
        ordered = await client.store.pool.fetchval(
            "SELECT min(at) FROM audit WHERE job_id = $1 AND event = 'preempt_ordered'", victim)
        first, second = log_of(victim, 1), log_of(victim, 2)
        grace_used = stamp(first, "EXIT") - stamp(first, "SIGTERM")
        latencies.append(stamp(second, "RAN") - ordered - grace_used)
        await client.cancel(victim)
        await client.wait(victim, timeout=60)
        await client.wait(critical, timeout=60)
        await client.wait(blocker, timeout=60)
    return {"rounds": count, "resume_p50_s": round(percentile(latencies, 50), 2),
            "resume_p95_s": round(percentile(latencies, 95), 2), "resume_max_s": round(max(latencies), 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="gpusched-bench-") as tmp:
        data_dir = Path(tmp) / "stack"
        figures = on_stack(data_dir, 2, 4, lambda c: rounds(c, data_dir, args.rounds))
    for key, value in figures.items():
        print(f"{key:>14}: {value}", file=sys.stderr)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
