"""When the GPUs held now come back to use, with this cycle's promises kept: the calendar that
reservations (admission, step g) and the estimate's walk (step 7) read.

A running job gives its GPUs back at its expected end, or at the end of its grace once told to
leave. GPUs promised to a job (an earmark: made when it preempted, or had others moved for it)
do not come back when the job on them leaves: they are its promised job's, and come back when
that job has run on them. A waiting claimant starts as the last of its promised GPUs is left,
a mover on its new GPUs as it leaves its old ones; each runs out its expected work there. A job
placed this cycle gives its GPUs back at the end of its expected run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping, Sequence

from scheduler.eta import MIN_RUN, remaining_work
from scheduler.expected_ends import Ends
from scheduler.models import Earmark, GpuSlot, QueuedJob, RunningJob

if TYPE_CHECKING:
    from scheduler.admission import Admission


# GPUs coming back to use: (at, job, slots, machines, counted): at `at`, all or some of one job's
# GPUs, `slots`; `machines` as (machine, GPU count) when all of a running job's come back, else
# None; `counted`, the GPUs its team stops holding then (a mover's team holds its count on, on its
# new GPUs). Plain tuples, read by unpacking: the calendar is made hundreds of times a simulated
# hour, and a running job's usual return is its entry of expected_ends, made once for its run.
Return = tuple[float, RunningJob | QueuedJob, Sequence[GpuSlot], list[tuple[int, int]] | None, int]


def promised_slots(earmarks: Mapping[str, Earmark]) -> dict[GpuSlot, str]:
    """Each promised GPU, and the job it is promised to."""
    return {slot: job_id for job_id, earmark in earmarks.items() for slot in earmark.gpus}


def gpus_coming_back(state: Admission, ends: Ends) -> tuple[list[Return], dict[str, float]]:
    """Every return of the GPUs of the running jobs (from their expected `ends`; lost jobs are
    the caller's) and of the jobs placed this cycle, with the waiting jobs that hold an earmark
    (claimants) starting on theirs; and when each of those starts. In order: the running jobs',
    the placed jobs', the claimants', the movers'."""
    now, config = state.now, state.config
    restart, grace, going, earmarks = config.expected_restart_s, config.grace_period, state.going, state.earmarks
    promised = promised_slots(earmarks)
    leave_at: dict[str, float] = {}  # per earmark holder: when the last of its promised GPUs is left
    out: list[Return]
    if not earmarks:  # nothing promised, so no mover either: every job's GPUs come back whole, at its end
        if going:
            left = now + grace
            out = [(left, *entry[1:]) if entry[1].spec.job_id in going else entry for entry in ends]
        else:
            out = list(ends)
    else:
        out = []
        none_promised = promised.keys().isdisjoint
        for entry in ends:
            end, job, gpus, machines, n = entry
            job_id = job.spec.job_id
            at = now + grace if job_id in going else end
            counted = 0 if job_id in earmarks else n
            if none_promised(gpus):
                out.append(entry if at == end and counted == n else (at, job, gpus, machines, counted))
                continue
            for slot in gpus:
                holder = promised.get(slot)
                if holder is not None:
                    leave_at[holder] = max(leave_at.get(holder, now), at)
            out.append((at, job, [slot for slot in gpus if slot not in promised], None, counted))
    for job, slots, _ in state.placed:
        out.append((now + remaining_work(job, restart), job, slots, None, job.spec.num_gpus))
    starts: dict[str, float] = {}
    for job in (job for job_id, job in state.claimants.items() if job_id in earmarks):  # those placed since: above
        spec = job.spec
        start = starts[spec.job_id] = leave_at.get(spec.job_id, now)
        out.append((start + remaining_work(job, restart), job, earmarks[spec.job_id].gpus, None, spec.num_gpus))
    for job in state.running if len(starts) < len(earmarks) else ():
        earmark = earmarks.get(job.spec.job_id)
        if earmark is not None:
            # A mover: it restarts on its new GPUs as it leaves its old ones, then runs out its
            # estimate; its team's count comes back as it ends.
            leaves = now + grace if job.spec.job_id in going else job.expected_end(now)
            rest = job.model_copy(update={"draining_until": None}).expected_end(now) - now
            out.append((leaves + max(rest, MIN_RUN) + restart, job, earmark.gpus, None, job.spec.num_gpus))
    return out, starts
