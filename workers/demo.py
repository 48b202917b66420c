"""A demo workload on a running stack (``gpusched dev up``): two teams, jobs of several sizes and
classes running the bundled example job (real work per step, checkpoints through jobkit); one that
fails, one cancelled, one bumped, a critical hotfix submitted late, and jobs preempted by more
important ones, which checkpoint in their grace period and resume from that checkpoint. Waits for
them and prints what happened.

    python -m workers.demo [--data-dir DIR] [--scale S]

``--scale`` multiplies the work (0.2 for a quick run). The demo makes preemption visible within
seconds by lowering the cluster's minimum runtime to 5 s (the default is 10 minutes).
"""

from __future__ import annotations

import argparse
import asyncio
import re
import sys
import time
from datetime import datetime
from pathlib import Path

from scheduler.models import Priority, Quota
from workers.client import GpuschedClient
from workers.settings import default_data_dir, load_settings
from workflows.types import JobRequest

STEP_SECONDS = 0.5

# (job id, team, GPUs, priority, steps, fail at step)
WORKLOAD = [
    ("pretrain-a", "vision", 4, "normal", 36, None),
    ("pretrain-b", "speech", 4, "low", 30, None),  # preempted by a more important job, resumes from its checkpoint
    ("finetune-1", "vision", 2, "high", 6, None),
    ("finetune-2", "speech", 2, "normal", 6, None),
    ("sweep-1", "vision", 1, "low", 4, None),
    ("sweep-2", "vision", 1, "low", 4, None),
    ("sweep-3", "vision", 1, "low", 4, None),
    ("eval-nan", "speech", 1, "normal", 3, 2),  # fails: exit code 3 at step 2
    ("video-gen", "vision", 8, "normal", 8, None),  # a gang across both machines
    ("abandoned", "speech", 4, "low", 40, None),  # cancelled while it waits
]


def command(steps: int, fail_at: int | None, scale: float) -> list[str]:
    cmd = [sys.executable, "-m", "workers.example_job", "--steps", str(steps),
           "--step-seconds", f"{STEP_SECONDS * scale:g}", "--backend", "python"]
    return cmd + (["--fail-at-step", str(fail_at)] if fail_at else [])


async def run(data_dir: Path | None, scale: float) -> int:
    async with await GpuschedClient.connect(load_settings(data_dir)) as gs:
        await gs.set_quota("vision", Quota(guaranteed=4, max=8, queue_cap=50))
        await gs.set_quota("speech", Quota(guaranteed=4, max=8, queue_cap=50))
        await gs.store.configure_cluster("c1", policy={"min_runtime": 5, "grace_period": 4})
        suffix = datetime.now().strftime("%H%M%S")
        ids = {}
        began = time.monotonic()

        async def submit(name, team, gpus, priority, steps, fail_at) -> None:
            job_id = f"{name}-{suffix}"
            ids[name] = job_id
            sub = await gs.submit(JobRequest(
                job_id=job_id, team=team, num_gpus=gpus, priority=priority,
                topology="block" if gpus > 4 else None, checkpoint_interval=4 * scale,
                expected_duration=steps * STEP_SECONDS * scale + 1, command=command(steps, fail_at, scale)))
            where = "placed" if sub.position == 0 else f"queued at position {sub.position}"
            print(f"submitted {job_id:<22} {team:<7} {gpus} GPU(s) {priority:<8} {where}, "
                  f"estimated start {sub.estimated_start}")

        for job in WORKLOAD:
            await submit(*job)
        await asyncio.sleep(0.5)
        print(f"\nbumping {ids['sweep-3']} to high; cancelling {ids['abandoned']}")
        await gs.bump(ids["sweep-3"], Priority.high)
        await gs.cancel(ids["abandoned"])
        await asyncio.sleep(max(6.0, 6 * scale))  # past pretrain-b's minimum runtime
        print()
        await submit("hotfix", "vision", 4, "critical", 4, None)
        views = [await gs.wait(job_id, timeout=600) for job_id in ids.values()]
        elapsed = time.monotonic() - began
        print(f"\nall {len(views)} jobs ended in {elapsed:.1f} s:\n")
        print(f"{'job':<24}{'state':<11}{'exit':>5}  {'attempts':>8}  {'checkpoints':>11}  GPUs of the last attempt")
        for v in views:
            a = v.attempts[-1] if v.attempts else None
            complete = sum(1 for c in v.checkpoints if c.complete)
            print(f"{v.job_id:<24}{v.state:<11}{v.exit_code if v.exit_code is not None else '-':>5}  "
                  f"{len(v.attempts):>8}  {complete:>11}  {' '.join(a.gpus) if a else ''}")
        failed = next(v for v in views if v.job_id == ids["eval-nan"])
        print(f"\n{failed.job_id} failed with: {failed.reason}")
        resumed_after_preemption = 0
        for v in views:
            if len(v.attempts) < 2:
                continue
            why = [e["reason"] for e in await gs.store.audit_trail(v.job_id) if e["event"] == "preempt_ordered"]
            print(f"\n{v.job_id} " + (f"was preempted: {'; '.join(why)}" if why else "ran again"))
            if why and any(a.resumed_from is not None for a in v.attempts[1:]):
                resumed_after_preemption += 1
            for a in v.attempts:
                start = f"resumed from checkpoint {a.resumed_from}" if a.resumed_from is not None else "from the start"
                if a.restart_s is not None:
                    start += f" (restored in {a.restart_s:.1f} s)"
                print(f"  attempt {a.attempt}: {start}, ended {a.end_reason}")
            resumed = re.search(r"starting at step \d+ \(resumed from seq \d+\)",
                                _log(data_dir, v.job_id, len(v.attempts)))
            if resumed:
                print(f"  its last attempt's log says: {resumed.group(0)}")
        return _check(views, ids, resumed_after_preemption)


def _check(views, ids: dict[str, str], resumed_after_preemption: int) -> int:
    """What the demo says it shows, checked: 0 when all of it happened, else 1 with what did not."""
    expected = {ids["eval-nan"]: "failed", ids["abandoned"]: "cancelled"}
    problems = [f"{v.job_id} ended {v.state}, expected {expected.get(v.job_id, 'succeeded')}"
                for v in views if v.state != expected.get(v.job_id, "succeeded")]
    if resumed_after_preemption == 0:
        problems.append("no job was preempted and then resumed from a checkpoint")
    if problems:
        print("\nthe demo did not go as it should: " + "; ".join(problems), file=sys.stderr)
        return 1
    print(f"\nchecked: every job ended as expected, and {resumed_after_preemption} preempted job(s) "
          "resumed from their checkpoints")
    return 0


def _log(data_dir: Path | None, job_id: str, attempt: int) -> str:
    root = data_dir or default_data_dir()
    return "".join(p.read_text() for p in root.glob(f"jobs/*/{job_id}/attempt-{attempt}.log"))


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
