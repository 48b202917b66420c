"""Consolidation on the real stack: a small job moves (checkpoint, restart in a gap elsewhere) so a
gang job gets the machine it left."""

from __future__ import annotations

import pytest

from live.jobs import example_job

pytestmark = pytest.mark.live


def _machine(path: str) -> str:
    return path.rsplit("/", 1)[0]


def test_a_small_job_moves_into_a_gap_so_a_gang_job_gets_its_machine(stack):
    s = stack(machines=2, gpus=8, policy={"min_runtime": 0, "grace_period": 10, "consolidation_wait": 0})
    long = example_job(steps=400, step_seconds=0.2)
    s.submit("f0", 7, long, priority="critical")
    s.until(lambda: s.status("f0").state == "running")
    s.submit("blk", 1, example_job(steps=20, step_seconds=0.2), priority="critical")
    s.until(lambda: s.status("blk").state == "running")
    s.submit("small", 1, example_job(steps=60, step_seconds=0.2), priority="low", checkpoint_interval=60)
    s.until(lambda: s.status("small").state == "running")
    s.submit("f1", 5, long, priority="critical")
    s.until(lambda: s.status("f1").state == "running")
    assert s.wait("blk").state == "succeeded"
    # Now the first machine has 1 free GPU, the second 2: the 3-GPU job fits on neither.
    s.submit("gang", 3, example_job(steps=2, step_seconds=0.2), priority="low")
    gang = s.wait("gang", timeout=90)
    assert gang.state == "succeeded"
    small = s.wait("small", timeout=90)
    first, second = small.attempts
    assert first.end_reason == "preempted" and second.resumed_from is not None
    f0 = _machine(s.status("f0").attempts[0].gpus[0])
    assert {_machine(p) for p in first.gpus} == {_machine(p) for p in gang.attempts[0].gpus} != {f0}
    assert {_machine(p) for p in second.gpus} == {f0}
