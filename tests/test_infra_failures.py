"""How many infrastructure failures in a row a job has met: five fail it, but a long attempt
between two failures starts the count again (a three-day job meets a machine's death now and
then with nothing wrong with it)."""

from __future__ import annotations

from datetime import timedelta

import pytest

from workflows.job import INFRA_STREAK_RESET, MAX_INFRA_FAILURES, infra_failures_with


@pytest.mark.parametrize("name, before, ran_for, after", [
    ("an attempt its agent never picked up adds one", 2, None, 3),
    ("an attempt that died within seconds adds one", 0, timedelta(seconds=20), 1),
    ("an attempt that ran just under the reset adds one", 4, INFRA_STREAK_RESET - timedelta(seconds=1),
     MAX_INFRA_FAILURES),
    ("an attempt that ran the reset or longer starts the count again", 4, INFRA_STREAK_RESET, 1),
    ("a day-long attempt lost to its machine is the first in a row", 3, timedelta(days=1), 1),
])
def test_infrastructure_failures_in_a_row(name, before, ran_for, after):
    assert infra_failures_with(before, ran_for) == after
