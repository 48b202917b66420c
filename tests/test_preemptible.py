"""A running job's exposed span (preemptible.py) says, for every `now`, exactly what the rules of
protection say: both its ends are hit to the last bit, with times and settings whose sums round."""

from __future__ import annotations

import math
import random

import pytest
from builders import config, job, mid, running

from scheduler.preemptible import exposed_span
from scheduler.preemption import protection


def _jobs(rng: random.Random):
    for k in range(60):
        started = rng.choice((0.0, 1_700_000_000.0, 1_700_000_000.1, 0.3, 123_456.789))
        b = running(job(f"j{k}")).on(mid(0, 0, 0), [0]).started(started)
        if rng.random() < 0.5:
            b = b.preempted_at(*(started - rng.choice((0.1, 10.0, 1000.0, 3599.9)) for _ in range(rng.randint(1, 3))))
        spec_job = b.build()
        if rng.random() < 0.3:  # cannot checkpoint
            spec_job = spec_job.model_copy(update={"spec": spec_job.spec.model_copy(update={"checkpoint_interval": None})})
        yield spec_job


@pytest.mark.parametrize("seed", range(5))
def test_the_exposed_span_agrees_with_protection_at_and_around_its_ends(seed):
    rng = random.Random(seed)
    settings = config(min_runtime=rng.choice((0.0, 600.0, 0.1)), thrash_window=rng.choice((3600.0, 0.7)),
                      thrash_max_preemptions=rng.choice((1, 2, 3)), max_unsaved_run=rng.choice((900.0, 0.0, 0.3)))
    for j in _jobs(rng):
        start, end = exposed_span(j, settings)
        times = {j.started_at + d for d in (-1.0, 0.0, 0.1, 0.3, 0.7, 600.0, 900.0, 3600.0, 5000.0)}
        for edge in (start, end):
            if math.isfinite(edge):
                times |= {edge, math.nextafter(edge, -math.inf), math.nextafter(edge, math.inf)}
        for now in times:
            assert (protection(j, now, settings) is None) == (start <= now < end), (j.spec.job_id, now, start, end)
