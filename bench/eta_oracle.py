#!/usr/bin/env python3
"""Offline study: how close could the estimated start get if the cycle knew the future?

    python bench/eta_oracle.py --trace out/seed.csv --fleet examples/fleet-seed.yaml

The ETA a user sees at submit comes from a walk (scheduler/eta.py) that knows two things only
approximately: when running jobs end (the users' estimates) and what work arrives later (a
forecast made from the last day's submissions, scheduler/forecast.py). This study asks which of
the two keeps the median ETA error above its target, by handing the same walk the truth.

It simulates the trace once with gpusched's policy and keeps, for every job that waited at
submit, the snapshot of its first cycle. Estimates never change a decision, so each variant below
re-runs that one cycle on a changed copy of the snapshot, and is judged on the same jobs and
actual starts as the simulator's report (jobs that waited over 10 minutes):

  as shipped         the snapshot as it was
  no forecast        no expected arrivals
  arrivals known     the trace's real later submissions instead of the forecast (with the users'
                     estimates of their durations), each counted in full or ramped in as the
                     forecast is (an arrival due t from now counts for t / ramp of its GPUs)
  all known          also every running job's GPUs come back when they really did, and queued
                     jobs and arrivals run for their real durations
  finally ending     the forecast as shipped, but every running job ends when it really ended
                     for good: a job preempted and restarted later gives its GPUs back only then
                     (by itself, and switched in only for estimates of over 1 hour)

For the jobs that waited over 4 hours it also counts, from their first-cycle snapshots, the GPUs
of running jobs that the walk expects back by its estimate against those whose jobs really had
finished by then, and how many of the difference were preempted in between (a preempted job's
GPUs go to the job that displaced it, and it queues again ahead of the waiting job, so the walk's
release of it never comes).

The walk itself is unchanged in every variant: it still does not preempt, so what it is told
about arrivals acts as GPUs they hold, not as the gangs they displace. Findings are in
docs/eta.md ("What if the estimate knew the future?").
"""

from __future__ import annotations

import argparse
import bisect
import sys
import time
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from scheduler.cycle import run_cycle  # noqa: E402
from scheduler.models import ExpectedArrival, Snapshot  # noqa: E402
from scheduler.sim.engine import Simulation, SimSettings  # noqa: E402
from scheduler.sim.report import ETA_MIN_WAIT_S, percentile  # noqa: E402
from scheduler.sim.trace import TraceJob  # noqa: E402
from workers.cli import load_inputs  # noqa: E402

HOUR = 3600.0
BUCKETS = ((ETA_MIN_WAIT_S, HOUR), (HOUR, 4 * HOUR), (4 * HOUR, 12 * HOUR), (12 * HOUR, float("inf")))


class FirstCycles(Simulation):
    """The simulation, keeping the first-cycle snapshot of every job that had to wait."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.first: dict[str, Snapshot] = {}
        self._last: Snapshot | None = None

    def snapshot(self, cluster, now):
        self._last = super().snapshot(cluster, now)
        return self._last

    def run_cycle(self, cluster, now):
        super().run_cycle(cluster, now)
        snap = self._last
        for job_id in snap.estimate_only or ():
            if self.jobs[job_id].state == "queued":
                self.first[job_id] = snap


Variant = Callable[[Snapshot], Snapshot]


def study(trace: list[TraceJob], fleet) -> list[tuple[str, dict]]:
    began = time.perf_counter()
    sim = FirstCycles(trace, fleet, "gpusched", SimSettings())
    result = sim.run()
    print(f"simulated in {time.perf_counter() - began:.0f} s", file=sys.stderr)
    judged = {j.job_id: j for j in result.jobs
              if j.first_start is not None and j.first_start - j.submit > ETA_MIN_WAIT_S and j.job_id in sim.first}

    true_duration = {t.spec.job_id: t.duration for t in trace}
    came_back = {(a.job_id, a.start): a.end for a in result.allocations}
    later = sorted(trace, key=lambda t: t.submit_time)
    submit_times = [t.submit_time for t in later]

    def arrivals(snap: Snapshot, real_durations: bool) -> tuple[ExpectedArrival, ...]:
        return tuple(ExpectedArrival.model_construct(
            at=t.submit_time, priority=t.spec.priority, num_gpus=t.spec.num_gpus,
            expected_duration=t.duration if real_durations else t.spec.expected_duration)
            for t in later[bisect.bisect_right(submit_times, snap.now):])

    def ramp(snap: Snapshot, seconds: float) -> Snapshot:
        return snap.model_copy(update={"config": snap.config.model_copy(update={"forecast_ramp": seconds})})

    def known_arrivals(seconds: float) -> Variant:
        return lambda snap: ramp(snap.model_copy(update={"expected_arrivals": arrivals(snap, False)}), seconds)

    def all_known(seconds: float) -> Variant:
        def variant(snap: Snapshot) -> Snapshot:
            running = tuple(
                r if r.draining else r.model_copy(update={"spec": r.spec.model_copy(update={
                    "expected_duration": came_back[(r.spec.job_id, r.started_at)] - r.started_at + r.progress_at_start})})
                for r in snap.running)
            queue = tuple(q.model_copy(update={"spec": q.spec.model_copy(update={
                "expected_duration": true_duration[q.spec.job_id]})}) for q in snap.queue)
            return ramp(snap.model_copy(update={"running": running, "queue": queue,
                                                "expected_arrivals": arrivals(snap, True)}), seconds)
        return variant

    variants: list[tuple[str, Variant]] = [
        ("as shipped (forecast, 2 h ramp)", lambda snap: snap),
        ("no forecast", lambda snap: snap.model_copy(update={"expected_arrivals": ()})),
    ]
    variants += [(f"arrivals known, {label}", known_arrivals(s)) for label, s in
                 (("in full", 1.0), ("1 h ramp", HOUR), ("2 h ramp", 2 * HOUR), ("4 h ramp", 4 * HOUR))]
    variants += [(f"all known, {label}", all_known(s)) for label, s in (("in full", 1.0), ("1 h ramp", HOUR))]

    finished = {j.job_id: j.finish for j in result.jobs}

    def finally_ending(snap: Snapshot) -> Snapshot:
        running = tuple(
            r if r.draining or finished[r.spec.job_id] is None else r.model_copy(update={"spec": r.spec.model_copy(
                update={"expected_duration": max(1.0, finished[r.spec.job_id] - r.started_at + r.progress_at_start)})})
            for r in snap.running)
        return snap.model_copy(update={"running": running})

    ending_name = "running jobs end when they finally do"
    variants.append((ending_name, finally_ending))

    def estimate(snap: Snapshot, job_id: str) -> float | None:
        decided = run_cycle(snap.model_copy(update={"estimate_only": frozenset({job_id})}))
        # Told the truth about durations, the cycle may place the job at once.
        if any(p.job_id == job_id for p in decided.placements):
            return snap.now
        return next(p.estimated_start for p in decided.pending if p.job_id == job_id)

    def judge(starts: dict[str, float | None]) -> dict:
        errors: list[tuple[float, float]] = []  # (relative error, actual wait)
        for job_id, job in judged.items():
            start = starts[job_id]
            if start is not None:
                wait = job.first_start - job.submit
                errors.append((abs(start - job.first_start) / wait, wait))
        return summarise(errors)

    rows = []
    starts: dict[str, dict[str, float | None]] = {}  # per variant, per job
    for name, variant in variants:
        starts[name] = {job_id: estimate(variant(sim.first[job_id]), job_id) for job_id in judged}
        rows.append((name, judge(starts[name])))
    shipped, ending = starts[variants[0][0]], starts[ending_name]
    switched = {job_id: ending[job_id] if start is not None and start - judged[job_id].submit > HOUR else start
                for job_id, start in shipped.items()}
    rows.append(("the same, for estimates of over 1 h only", judge(switched)))
    print(releases_counted(judged, sim.first, shipped, finished, result.allocations), file=sys.stderr)
    return rows


def releases_counted(judged: dict, first: dict[str, Snapshot], shipped: dict[str, float | None],
                     finished: dict[str, float | None], allocations) -> str:
    """For the jobs that waited over 4 h: of the running jobs' GPUs the walk expects back by its
    estimate, how many fewer really came back for good by then, and how many of the walk's were
    of jobs preempted before it and not yet finished (medians over the jobs, as shares)."""
    preempted_at = {(a.job_id, a.start): a.end for a in allocations if a.reason != "completed"}
    fewer, displaced = [], []
    for job_id, job in judged.items():
        at = shipped[job_id]
        if at is None or job.first_start - job.submit <= 4 * HOUR:
            continue
        snap = first[job_id]
        expected = really = gone = 0
        for r in snap.running:
            gpus, end = r.spec.num_gpus, finished[r.spec.job_id]
            done = end is not None and end <= at
            if r.expected_end(snap.now) <= at:
                expected += gpus
                if not done and preempted_at.get((r.spec.job_id, r.started_at), float("inf")) <= at:
                    gone += gpus
            if done:
                really += gpus
        if expected:
            fewer.append((expected - really) / expected)
            displaced.append(gone / expected)
    if not fewer:
        return "no judged job waited over 4 hours"
    return (f"waits over 4 h ({len(fewer)} jobs): of the running jobs' GPUs the walk expects back by its "
            f"estimate, {100 * percentile(fewer, 50):.0f}% fewer really came back for good by then (median); "
            f"{100 * percentile(displaced, 50):.0f}% were of jobs preempted before it and not yet finished")


def summarise(errors: list[tuple[float, float]]) -> dict:
    out = {"jobs": len(errors), "median": percentile([e for e, _ in errors], 50),
           "within_30": sum(1 for e, _ in errors if e <= 0.3)}
    for lo, hi in BUCKETS:
        part = [e for e, w in errors if lo < w <= hi]
        out[(lo, hi)] = (len(part), percentile(part, 50) if part else None)
    return out


def span(lo: float, hi: float) -> str:
    """A bucket of waits in words: "10–60 min", "1–4 h", "> 12 h"."""
    return f"{lo / 60:.0f}–60 min" if hi == HOUR else (f"> {lo / HOUR:.0f} h" if hi == float("inf")
                                                        else f"{lo / HOUR:.0f}–{hi / HOUR:.0f} h")


def table(rows: list[tuple[str, dict]]) -> str:
    first = rows[0][1]
    head = ["estimate", "median error", "within 30%"] + [f"{span(lo, hi)} ({first[(lo, hi)][0]})" for lo, hi in BUCKETS]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for name, r in rows:
        cells = [name, f"{100 * r['median']:.1f}%", f"{r['within_30']} of {r['jobs']}"]
        cells += [f"{100 * r[b][1]:.0f}%" if r[b][1] is not None else "—" for b in BUCKETS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", required=True)
    parser.add_argument("--fleet", required=True)
    args = parser.parse_args(argv)
    trace, fleet = load_inputs(args.trace, args.fleet)
    print(table(study(trace, fleet)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
