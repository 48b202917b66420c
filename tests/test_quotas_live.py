"""Fair share on the real stack: GPUs that free up go to a team under its guarantee before a more
important job of a team that would borrow them."""

from __future__ import annotations

from datetime import datetime

import pytest

from live.jobs import sleeper
from scheduler.models import Quota

pytestmark = pytest.mark.live


def _started(view) -> datetime:
    return datetime.fromisoformat(view.attempts[0].started_at)


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
    assert _started(owed) < _started(borrower)
    assert _started(borrower) >= datetime.fromisoformat(owed.attempts[0].ended_at)
    assert [a.end_reason for a in owed.attempts] == ["completed"]
