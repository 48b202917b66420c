"""When each running job may be preempted: the span of time its protections leave it exposed.

`preemption.protection` says whether a job is protected at a given time: it has run less than
the minimum runtime, it was preempted too often lately (thrash), or it cannot checkpoint and has
run too long to throw away. The first two end at some time, the third begins at one, and in
between the job may be displaced. Both times depend only on the job and the policy, so they
are worked out once per running job, kept per cluster from cycle to cycle (since_last_cycle.py),
and a cycle only asks whether its `now` lies between them: a comparison per job instead of the
rules again, several times a cycle (the unprotected jobs, those below each class, the borrowed).

The times are exact: each is the first `now` at which its rule, in its own arithmetic, gives the
other answer (stepping past rounding with math.nextafter), so the answers are `protection`'s.
"""

from __future__ import annotations

import math
from typing import Sequence

from scheduler.models import PolicyConfig, RunningJob
from scheduler.since_last_cycle import PerCluster, PerRunningJob


def exposed_span(job: RunningJob, config: PolicyConfig) -> tuple[float, float]:
    """(start, end): `protection(job, now, config)` is None exactly when start <= now < end."""
    start = first_past(job.started_at, config.min_runtime, strictly=False)
    most = config.thrash_max_preemptions
    if len(job.preemptions) >= most:
        # Protected while `most` preemptions lie within the window: until the window has passed
        # the most-th latest of them.
        latest = sorted(job.preemptions)[-most]
        start = max(start, first_past(latest, config.thrash_window, strictly=True))
    end = math.inf if job.spec.checkpoints else first_past(job.started_at, config.max_unsaved_run, strictly=True)
    return start, end


def first_past(since: float, length: float, strictly: bool) -> float:
    """The least time t with t - since >= length (> length when `strictly`), as floats compute it."""
    if not math.isfinite(length):
        return math.inf if length > 0 else -math.inf

    def past(t: float) -> bool:
        return t - since > length if strictly else t - since >= length

    t = since + length
    while not past(t):
        t = math.nextafter(t, math.inf)
    while past(earlier := math.nextafter(t, -math.inf)):
        t = earlier
    return t


class ExposedNow:
    """Which running jobs protection leaves exposed at `now`, from their kept spans."""

    def __init__(self, spans: dict[int, tuple[RunningJob, float, float]], running: Sequence[RunningJob], now: float):
        self._spans, self._running, self.now = spans, running, now

    def __call__(self, job: RunningJob) -> bool:
        """Whether `job` (one of the running jobs) may be preempted now."""
        _, start, end = self._spans[id(job)]
        return start <= self.now < end

    def unprotected(self) -> list[RunningJob]:
        """The running jobs, in order, that are neither draining nor protected."""
        now = self.now
        spans = list(map(self._spans.__getitem__, map(id, self._running)))
        return [job for job, start, end in spans if start <= now < end and job.draining_until is None]


def exposed_now(cluster: str, running: Sequence[RunningJob], now: float, config: PolicyConfig) -> ExposedNow:
    if not isinstance(running, (list, tuple)):
        running = tuple(running)
    rules = (config.min_runtime, config.thrash_window, config.thrash_max_preemptions, config.max_unsaved_run)
    with _kept.lock:
        spans = _kept.get(cluster, lambda kept: kept.update(rules, running), lambda: _Spans(rules, config, running))
        return ExposedNow(spans.by_job, running, now)


class _Spans(PerRunningJob):
    """Per running job (by identity): the job and its exposed span under one set of rules."""

    def __init__(self, rules: tuple, config: PolicyConfig, running: Sequence[RunningJob]):
        self.rules = rules
        super().__init__(lambda job: exposed_span(job, config), running)

    def update(self, rules: tuple, running: Sequence[RunningJob]) -> bool:
        """False when the rules changed or most jobs did (build anew)."""
        return rules == self.rules and self.follow(running)


_kept: PerCluster[_Spans] = PerCluster()
