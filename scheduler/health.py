"""Health: GPUs that cannot be used leave the inventory, and the jobs on them leave too.

A machine that stopped answering takes all its GPUs out; its jobs are gone with it and restart
from their last complete checkpoint (not graceful). A single sick GPU takes only itself out; its
job is still alive, so it is asked to checkpoint and move (graceful). A machine an operator drains
for maintenance is healthy but to be emptied: its jobs are asked to checkpoint and move too.
"""

from __future__ import annotations

from typing import Sequence

from scheduler.capacity import all_on_healthy_machines
from scheduler.models import Machine, Requeue, RunningJob, gpu_path


def jobs_to_requeue(machines: Sequence[Machine], running: Sequence[RunningJob]) -> list[Requeue]:
    if all_on_healthy_machines(machines, running):
        return []
    by_id = {m.id: m for m in machines}
    requeues = []
    for job in running:
        dead = sick = drained = None
        for slot in job.gpus:
            machine = by_id.get(slot[0])
            if machine is None or not machine.reachable:
                dead = slot[0]
                break
            if slot[1] in machine.unhealthy_gpus and sick is None:
                sick = slot
            if machine.drain and drained is None:
                drained = slot[0]
        if dead is not None:
            requeues.append(
                Requeue(job_id=job.spec.job_id, reason=f"machine {dead} is unreachable", graceful=False)
            )
        elif job.draining:
            continue  # already told to checkpoint and stop: it leaves within its grace
        elif sick is not None:
            requeues.append(
                Requeue(job_id=job.spec.job_id, reason=f"GPU {gpu_path(sick)} is unhealthy", graceful=True)
            )
        elif drained is not None:
            requeues.append(
                Requeue(job_id=job.spec.job_id, reason=f"machine {drained} is being drained", graceful=True)
            )
    return requeues
