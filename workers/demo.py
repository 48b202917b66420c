"""A demo workload on a running stack (``gpusched dev up``): two teams, jobs of several sizes and
classes, one that fails, one cancelled, one bumped; waits for them and prints what happened.

    python -m workers.demo [--data-dir DIR] [--scale S]

Each job is a small Python program that reports its GPUs and works for a few seconds. ``--scale``
multiplies the work (0.2 for a quick run).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from datetime import datetime
from pathlib import Path

from scheduler.models import Priority, Quota
from workers.client import GpuschedClient
from workers.settings import load_settings
from workflows.types import JobRequest

WORK = ("import os, sys, time\n"
        "steps = int(sys.argv[1])\n"
        "print('job', os.environ['GPUSCHED_JOB_ID'], 'on GPUs', os.environ['GPUSCHED_GPUS'], flush=True)\n"
        "for step in range(steps):\n"
        "    time.sleep(0.5)\n"
        "    print('step', step + 1, 'of', steps, flush=True)\n"
        "sys.exit(int(sys.argv[2]))\n")

# (job id, team, GPUs, priority, steps, exit code)
WORKLOAD = [
    ("pretrain-a", "vision", 4, "normal", 16, 0),
    ("pretrain-b", "speech", 4, "normal", 12, 0),
    ("finetune-1", "vision", 2, "high", 6, 0),
    ("finetune-2", "speech", 2, "normal", 6, 0),
    ("sweep-1", "vision", 1, "low", 4, 0),
    ("sweep-2", "vision", 1, "low", 4, 0),
    ("sweep-3", "vision", 1, "low", 4, 0),
    ("eval-nan", "speech", 1, "normal", 3, 3),  # fails: exit code 3
    ("video-gen", "vision", 8, "normal", 8, 0),  # a gang across both machines
    ("abandoned", "speech", 4, "low", 40, 0),  # cancelled while it waits
]


def command(steps: int, code: int, scale: float) -> list[str]:
    return [sys.executable, "-c", WORK, str(max(1, round(steps * scale))), str(code)]


async def run(data_dir: Path | None, scale: float) -> int:
    async with await GpuschedClient.connect(load_settings(data_dir)) as gs:
        await gs.set_quota("vision", Quota(guaranteed=4, max=8, queue_cap=50))
        await gs.set_quota("speech", Quota(guaranteed=4, max=8, queue_cap=50))
        suffix = datetime.now().strftime("%H%M%S")
        ids = {}
        began = time.monotonic()
        for name, team, gpus, priority, steps, code in WORKLOAD:
            job_id = f"{name}-{suffix}"
            ids[name] = job_id
            topology = "block" if gpus > 4 else None
            sub = await gs.submit(JobRequest(job_id=job_id, team=team, num_gpus=gpus, priority=priority,
                                             topology=topology, expected_duration=steps * 0.5 * scale + 1,
                                             command=command(steps, code, scale)))
            where = "placed" if sub.position == 0 else f"queued at position {sub.position}"
            print(f"submitted {job_id:<22} {team:<7} {gpus} GPU(s) {priority:<7} {where}, "
                  f"estimated start {sub.estimated_start}")
        await asyncio.sleep(0.5)
        print(f"\nbumping {ids['sweep-3']} to high; cancelling {ids['abandoned']}")
        await gs.bump(ids["sweep-3"], Priority.high)
        await gs.cancel(ids["abandoned"])
        views = [await gs.wait(job_id, timeout=600) for job_id in ids.values()]
        elapsed = time.monotonic() - began
        print(f"\nall {len(views)} jobs ended in {elapsed:.1f} s:\n")
        print(f"{'job':<24}{'state':<11}{'exit':>5}  {'waited':>7}  {'ran':>6}  GPUs")
        for v in views:
            a = v.attempts[-1] if v.attempts else None
            waited = ran = "-"
            if a and a.started_at:
                waited = f"{_seconds(v.submitted_at, a.started_at):.1f}s"
                if a.ended_at:
                    ran = f"{_seconds(a.started_at, a.ended_at):.1f}s"
            gpus = " ".join(a.gpus) if a else ""
            print(f"{v.job_id:<24}{v.state:<11}{v.exit_code if v.exit_code is not None else '-':>5}  "
                  f"{waited:>7}  {ran:>6}  {gpus}")
        failed = next(v for v in views if v.job_id == ids["eval-nan"])
        print(f"\n{failed.job_id} failed with: {failed.reason}")
        return 0


def _seconds(start: str, end: str) -> float:
    return (datetime.fromisoformat(end) - datetime.fromisoformat(start)).total_seconds()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m workers.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", type=Path, default=None)
    parser.add_argument("--scale", type=float, default=1.0)
    args = parser.parse_args(argv)
    sys.exit(asyncio.run(run(args.data_dir, args.scale)))


if __name__ == "__main__":
    main()
