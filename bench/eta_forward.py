#!/usr/bin/env python3
"""Offline study: would simulating the real policy forward estimate starts better than the walk?

    python bench/eta_forward.py --trace out/seed.csv --fleet examples/fleet-seed.yaml [--workers 2]

The estimate a user sees (scheduler/eta.py) walks the queue forward without preempting, and
learns of later work only through a fluid forecast. bench/eta_oracle.py showed that telling that
walk the truth does not bring it to the target. This study swaps the walk for the policy itself:
at the first cycle of every job that had to wait, the simulation is forked (os.fork, so Linux or
macOS), and the copy is changed to know only what the scheduler knew at that moment:

  - running jobs end at their expected end (`RunningJob.expected_end`, as the walk assumes), and
    queued jobs run for the users' estimates, not their real durations;
  - later submissions are replaced, per variant:
      arrivals known      the trace's real later submissions, running for the users' estimates
      no arrivals         none
      yesterday again     the last day's submissions, each submitted again one and two days
                          later (same team, class, shape and estimate): the forecast a live
                          loop could make from what it has seen
      ... to the end      the same, but nothing after the trace's last submission: a finite
                          trace has no day after it, which no forecast knows (a diagnostic)

Then the copy runs the same cycle function forward, estimates off, until the job starts; that
time is the variant's estimate. With nothing changed the copy reproduces the real start exactly,
so what each variant gets wrong is what it did not know. Judged like the simulator's report: jobs
that waited over 10 minutes, error relative to the actual wait.

Slow by design: one forward simulation per job and variant (two variants took 15 minutes on the
seed trace with two workers, so the four about half an hour). Findings are in docs/eta.md
("What if the policy itself were run forward?").
"""

from __future__ import annotations

import argparse
import heapq
import json
import os
import sys
import tempfile
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from scheduler.eta import MIN_RUN  # noqa: E402
from scheduler.sim.engine import FINISH, SUBMIT, JobLife, Simulation, SimSettings, simulate  # noqa: E402
from scheduler.sim.report import ETA_MIN_WAIT_S  # noqa: E402
from scheduler.sim.trace import TraceJob  # noqa: E402
from workers.cli import load_inputs  # noqa: E402

from eta_oracle import summarise, table  # noqa: E402  (bench/ is this script's folder)

DAY = 86400.0
HORIZON = 6 * DAY  # a forward run that has not started the job by then gives no estimate
VARIANTS = {
    "arrivals known": "known",
    "no arrivals": "none",
    "yesterday again": "replay",
    "yesterday again, to the trace's end": "replay-to-end",
}


class Started(Exception):
    """The job a forward run was made for has started (args: the time)."""


class AllForked(Exception):
    """Every judged job has its forward runs: the real run need not go on."""


class ForwardRuns(Simulation):
    """The simulation, forking a forward run at the first cycle of each job that waits."""

    def __init__(self, trace: list[TraceJob], fleet, judged: set[str], variants: list[str], workers: int,
                 out: Path):
        super().__init__(trace, fleet, "gpusched", SimSettings())
        self.by_submit = sorted(trace, key=lambda t: t.submit_time)
        self.judged = judged  # the jobs that wait over 10 minutes: only those are forked for
        self.variants = variants
        self.workers, self.out, self.children, self.failed = workers, out, 0, 0
        self.target: str | None = None  # set in a forward run only
        self.forked_at, self.changed = 0.0, False

    # --- in the real run -----------------------------------------------------------------------

    def run_cycle(self, cluster, now):
        arrived = list(cluster.arrived)
        super().run_cycle(cluster, now)
        if self.target is None:
            for job_id in arrived:
                if job_id in self.judged and self.jobs[job_id].state == "queued":
                    for variant in self.variants:
                        self.fork(job_id, now, variant)
                    self.judged = self.judged - {job_id}
                    if not self.judged:
                        raise AllForked

    def fork(self, job_id: str, now: float, variant: str) -> None:
        while self.children >= self.workers:
            self.reap()
        if os.fork():
            self.children += 1
            return
        try:  # the copy must never return into the real run's frames
            try:
                self.forward(job_id, now, variant)
                start = None
            except Started as started:
                start = started.args[0]
            (self.out / f"{variant}.{job_id}.json").write_text(json.dumps({"start": start}))
        except BaseException:
            traceback.print_exc()
            os._exit(1)
        os._exit(0)

    def reap(self) -> None:
        _, status = os.wait()
        self.children -= 1
        if status:
            self.failed += 1

    def wait_all(self) -> None:
        while self.children:
            self.reap()
        if self.failed:
            raise SystemExit(f"{self.failed} forward run(s) failed (tracebacks above)")

    # --- in a forward run ----------------------------------------------------------------------

    def snapshot(self, cluster, now):
        snap = super().snapshot(cluster, now)
        if self.target is None:
            return snap
        return snap.model_copy(update={"estimate": False, "estimate_only": frozenset(), "expected_arrivals": ()})

    def place(self, cluster, now, job_id, gpus, phase):
        if self.changed:
            life = self.jobs[job_id]
            if life.trace.duration < life.progress + MIN_RUN:
                # Preempted after outrunning its estimate: like the walk, expect a minute more.
                self.expect(life, life.trace.submit_time)
        super().place(cluster, now, job_id, gpus, phase)
        if job_id == self.target:
            raise Started(now)

    def apply_event(self, now, kind, payload):
        if self.target is not None and now < self.forked_at:
            raise AssertionError(f"a forward run went back in time: {now} < {self.forked_at}")
        return super().apply_event(now, kind, payload)

    def forward(self, job_id: str, now: float, variant: str) -> None:
        self.target, self.forked_at, self.changed = job_id, now, variant != "unchanged"
        self.settings = self.settings.model_copy(update={"until": now + HORIZON})
        ends = [e for e in self.events if e[1] == FINISH]
        if variant == "unchanged":
            self._run()
            return
        self.events = [e for e in self.events if e[1] != FINISH and not (e[1] == SUBMIT and e[0] > now)]
        heapq.heapify(self.events)
        for life in self.jobs.values():
            if life.state in ("queued", "running", "draining"):
                self.expect(life, life.trace.submit_time)
        for _, _, _, (running_id, attempt) in ends:
            life = self.jobs[running_id]
            if life.state == "running" and life.attempt == attempt:
                self.push(life.running.expected_end(now), FINISH, (running_id, attempt))
        if variant == "known":
            for t in self.by_submit:
                if t.submit_time > now:
                    self.expect(self.jobs[t.spec.job_id], t.submit_time)
                    self.push(t.submit_time, SUBMIT, t.spec.job_id)
        elif variant.startswith("replay"):
            last = self.by_submit[-1].submit_time if variant == "replay-to-end" else float("inf")
            for days in (1, 2):
                for t in self.by_submit:
                    at = t.submit_time + days * DAY
                    if now - DAY < t.submit_time <= now and at <= last:
                        again = f"{t.spec.job_id}+{days}d"
                        deadline = t.spec.deadline + days * DAY if t.spec.deadline is not None else None
                        spec = t.spec.model_copy(update={"job_id": again, "deadline": deadline})
                        self.jobs[again] = JobLife(trace=TraceJob.model_construct(
                            spec=spec, submit_time=at, duration=t.duration), cluster="")
                        self.expect(self.jobs[again], at)
                        self.push(at, SUBMIT, again)
        self._run()

    @staticmethod
    def expect(life: JobLife, submit_time: float) -> None:
        """The job runs for its user's estimate (at least a minute beyond the work it has saved)."""
        duration = max(life.progress + MIN_RUN, life.spec.expected_duration)
        life.trace = TraceJob.model_construct(spec=life.spec, submit_time=submit_time, duration=duration)


def study(trace: list[TraceJob], fleet, workers: int, first: int | None, check: bool) -> list[tuple[str, dict]]:
    # A first run finds the jobs to judge; the second, identical up to each fork, forks for them.
    jobs = [job for job in simulate(trace, fleet).jobs
            if job.first_start is not None and job.first_start - job.submit > ETA_MIN_WAIT_S][:first]
    variants = dict(VARIANTS, **({"unchanged (a check: must be 0)": "unchanged"} if check else {}))
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch)
        sim = ForwardRuns(trace, fleet, {job.job_id for job in jobs}, list(variants.values()), workers, out)
        try:
            sim.run()
        except AllForked:
            pass
        sim.wait_all()
        rows = []
        for name, variant in [("as shipped (the walk)", None), *variants.items()]:
            errors = []
            for job in jobs:
                if variant is None:
                    start = job.predicted_start
                else:
                    start = json.loads((out / f"{variant}.{job.job_id}.json").read_text())["start"]
                if start is not None:
                    wait = job.first_start - job.submit
                    errors.append((abs(start - job.first_start) / wait, wait))
            rows.append((name, summarise(errors)))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", required=True)
    parser.add_argument("--fleet", required=True)
    parser.add_argument("--workers", type=int, default=2, help="forward runs at once")
    parser.add_argument("--first", type=int, help="judge only the first N jobs that waited (a quick look)")
    parser.add_argument("--check", action="store_true",
                        help="also fork runs that change nothing: they must reproduce every start")
    args = parser.parse_args(argv)
    trace, fleet = load_inputs(args.trace, args.fleet)
    print(table(study(trace, fleet, args.workers, args.first, args.check)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
