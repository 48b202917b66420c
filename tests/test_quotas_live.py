"""Fair share on the real stack: GPUs that free up go to a team under its guarantee before a more
important job of a team that would borrow them."""

from __future__ import annotations

import re
from datetime import datetime

import pytest

from live.jobs import example_job, sleeper
from scheduler.models import Quota

pytestmark = pytest.mark.live


def _started(attempt) -> datetime:
    return datetime.fromisoformat(attempt.started_at)


def _ended(attempt) -> datetime:
    return datetime.fromisoformat(attempt.ended_at)


def test_a_freed_machine_goes_to_a_low_job_within_its_guarantee_before_a_critical_borrower(stack):
    # Nobody may be preempted here (minimum runtime), so only the order of admission decides.
    s = stack(machines=1, gpus=4, policy={"min_runtime": 600, "grace_period": 10})
    s.run(s.client.set_quota("ops", Quota(guaranteed=100, max=100)))  # never borrowing
    s.run(s.client.set_quota("labs", Quota(guaranteed=0, max=64)))  # everything it runs is borrowed
    s.submit("blocker", 4, sleeper(8), team="ops", priority="critical")
    s.until(lambda: s.status("blocker").state == "running")
    s.submit("borrower", 4, sleeper(0.5), team="labs", priority="critical")
    s.submit("owed", 4, sleeper(2), priority="low")  # team vision: guarantee 8, holds nothing
    s.until(lambda: s.status("owed").reason and s.status("borrower").reason, timeout=10)
    owed, borrower = s.wait("owed"), s.wait("borrower")
    assert owed.state == borrower.state == "succeeded"
    assert _started(owed.attempts[0]) < _started(borrower.attempts[0])
    assert _started(borrower.attempts[0]) >= _ended(owed.attempts[0])
    assert [a.end_reason for a in owed.attempts] == ["completed"]


def test_a_team_under_its_guarantee_reclaims_a_critical_borrowed_job_which_resumes_from_its_checkpoint(stack):
    """And the critical job, now waiting, does not preempt the low one back: that would take from
    team vision's guarantee (before, the two took turns until thrash protection stopped them)."""
    s = stack(machines=1, gpus=4, policy={"min_runtime": 0, "grace_period": 10})
    s.run(s.client.set_quota("labs", Quota(guaranteed=0, max=64)))
    # 12 s of work: the reclaim has 11 s from step 5 to come, not ending the job first.
    s.submit("borrowed", 4, example_job(steps=60, step_seconds=0.2), team="labs", priority="critical",
             checkpoint_interval=60)
    s.until(lambda: re.search(r"^step 5/60", s.log("borrowed"), re.M))
    s.submit("owed", 4, sleeper(1), priority="low")  # team vision: guarantee 8, holds nothing
    owed = s.wait("owed")
    assert owed.state == "succeeded"
    assert [a.end_reason for a in owed.attempts] == ["completed"]
    view = s.wait("borrowed", timeout=90)
    assert view.state == "succeeded"
    first, second = view.attempts
    assert first.end_reason == "preempted"
    assert second.resumed_from is not None  # the checkpoint it took in its grace period
    assert _started(second) >= _ended(owed.attempts[0])
