"""Following the running jobs between cycles: each follower is told exactly which jobs ended and
which started since it last looked, whether it works that out itself or takes it from another
follower that went from the same jobs to the same jobs."""

from __future__ import annotations

import random

from builders import job, mid, running

from scheduler.since_last_cycle import RunningChanges


def test_followers_that_look_at_different_cycles_each_get_their_own_changes():
    rng = random.Random(3)
    pool = [running(job(f"j{k}")).on(mid(0, 0, k % 8), [k // 8]).build() for k in range(64)]
    jobs = pool[:40]
    followers = [RunningChanges(jobs) for _ in range(4)]
    seen = [list(jobs) for _ in followers]
    for step in range(60):
        ended = set(rng.sample(range(len(jobs)), rng.randint(0, 3)))
        jobs = [j for k, j in enumerate(jobs) if k not in ended]
        jobs += rng.sample([j for j in pool if all(j is not other for other in jobs)], rng.randint(0, 3))
        for k, follower in enumerate(followers):
            if k and rng.random() < 0.4:
                continue  # this one skips the cycle (a stage the cycle did not need)
            # A list equal to the jobs but not the same object, as each stage builds its own.
            changes = follower.since(list(jobs))
            if changes is None:
                followers[k] = RunningChanges(jobs)
            else:
                gone, new = changes
                before = {id(j) for j in seen[k]}
                after = {id(j) for j in jobs}
                assert {id(j) for j in gone} == before - after
                assert {id(j) for j in new} == after - before
            seen[k] = list(jobs)


def test_jobs_that_ended_are_dropped_from_what_is_kept_per_job():
    """Kept, they would grow without bound over a long-running loop."""
    from scheduler.since_last_cycle import PerRunningJob

    jobs = [running(job(x).gpus(1)).on(mid(0, 0, 0), [k]).build() for k, x in enumerate("abcd")]
    kept = PerRunningJob(lambda j: (), jobs)
    assert kept.follow(jobs[1:])
    assert len(kept.by_job) == 3


def test_work_kept_per_job_is_done_again_against_something_new():
    from scheduler.since_last_cycle import PerJob

    a = running(job("a").gpus(1)).on(mid(0, 0, 0), [0]).build()
    kept = PerJob(lambda job, against: against)
    kept.get(a, "old")
    assert kept.get(a, "new") == "new"
