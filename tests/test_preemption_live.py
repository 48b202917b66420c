"""Preemption on the real stack: the victim gets its grace period, checkpoints, gives its GPUs to
the more important job, and later resumes from that checkpoint (its step counter continues)."""

from __future__ import annotations

import re
import sys

import pytest

from live.jobs import example_job

pytestmark = pytest.mark.live


def test_a_critical_job_preempts_a_low_one_which_checkpoints_in_its_grace_and_resumes_from_it(stack):
    s = stack(machines=1, gpus=4, policy={"min_runtime": 0, "grace_period": 10})
    # 12 s of work: the preemption has 11 s from step 5 to come (the agent hears of it at its
    # next heartbeat), not ending the job first on a slow machine.
    s.submit("low", 4, example_job(steps=60, step_seconds=0.2), priority="low", checkpoint_interval=60)
    s.until(lambda: re.search(r"^step 5/60", s.log("low"), re.M))
    s.submit("urgent", 4, example_job(steps=2, step_seconds=0.2), priority="critical")
    assert s.wait("urgent").state == "succeeded"
    view = s.wait("low", timeout=90)
    assert view.state == "succeeded"
    first, second = view.attempts
    assert first.end_reason == "preempted" and first.resumed_from is None
    # The checkpoint taken on SIGTERM, inside the grace period, is the one the second attempt used.
    stopping = re.search(r"stopped at step (\d+) after checkpoint seq (\d+) \(committed=True\)", s.log("low"))
    assert stopping, s.log("low")
    step, seq = int(stopping.group(1)), int(stopping.group(2))
    assert second.resumed_from == seq
    # The resumed attempt reported how long it took to have its state back, and the scheduler
    # now expects resumed jobs on this cluster to take about that long.
    assert second.restart_s is not None and 0 <= second.restart_s < 30 and first.restart_s is None
    assert s.run(s.client.store.snapshot("c1")).config.expected_restart_s == second.restart_s
    assert [c.seq for c in view.checkpoints if c.complete][-1] >= seq
    resumed = s.log("low", attempt=2)
    assert f"starting at step {step} (resumed from seq {seq})" in resumed
    assert re.search(rf"^step {step + 1}/60", resumed, re.M) and not re.search(r"^step 1/60", resumed, re.M)
    assert re.search(r"final_state=[0-9a-f]+", resumed)
    preemptions = s.sql("SELECT preemptions FROM jobs WHERE id = 'low'")[0]["preemptions"]
    assert len(preemptions) == 1
    events = [e["event"] for e in s.run(s.client.store.audit_trail("low"))]
    assert events.index("preempt_ordered") < events.index("checkpoint_committed") < events.index("released")


# On SIGTERM it takes 13 s to save (longer than the agent's 10 s heartbeat timeout), then exits;
# resumed, it says from which checkpoint and ends.
SLOW_SAVE = [sys.executable, "-c", """
import sys, time
from jobkit import Checkpointer
ck = Checkpointer.from_env()
ck.handle_sigterm()
if ck.restore() is not None:
    print("resumed from", ck.resume_seq, flush=True)
    sys.exit(0)
print("running", flush=True)
while not ck.stop_requested:
    time.sleep(0.1)
time.sleep(13)
saved = ck.save(b"state", progress=1)
print("saved", saved.seq, saved.committed, flush=True)
"""]


def resumed_from_the_save_in_its_grace(s) -> str:
    """`slow` was preempted by `urgent`, saved in its grace, and resumed from that save: its seq."""
    assert s.wait("urgent").state == "succeeded"
    view = s.wait("slow", timeout=60)
    assert view.state == "succeeded", view
    first, second = view.attempts
    assert first.end_reason == "preempted", first
    saved = re.search(r"^saved (\d+) True$", s.log("slow"), re.M)
    assert saved, s.log("slow")
    assert second.resumed_from == int(saved.group(1))
    return saved.group(1)


def test_a_victim_whose_checkpoint_takes_longer_than_the_heartbeat_timeout_keeps_its_whole_grace(stack):
    """While its job saves, the agent heartbeats the cancelled attempt: a quiet stop would be timed
    out by the server at 10 s, the GPUs given to the preemptor and the checkpoint refused."""
    s = stack(machines=1, gpus=4, policy={"min_runtime": 0, "grace_period": 25})
    s.submit("slow", 4, SLOW_SAVE, priority="low")
    s.until(lambda: "running" in s.log("slow"))
    s.submit("urgent", 4, example_job(steps=1, step_seconds=0.1), priority="critical")
    assert f"resumed from {resumed_from_the_save_in_its_grace(s)}" in s.log("slow", attempt=2)


def test_a_job_inside_its_minimum_runtime_is_not_preempted(stack):
    s = stack(machines=1, gpus=4, policy={"min_runtime": 600, "grace_period": 10})
    # Long enough that a preemption, were it allowed, would come well before its end.
    s.submit("young", 4, example_job(steps=40, step_seconds=0.25), priority="low")
    s.until(lambda: s.status("young").state == "running")
    s.submit("urgent", 4, example_job(steps=1, step_seconds=0.1), priority="critical")
    s.until(lambda: "protected from preemption" in (s.status("urgent").pending_reason or ""), timeout=10)
    assert s.status("young").state == "running"
    assert s.wait("young", timeout=60).attempts[0].end_reason == "completed"
    assert s.wait("urgent").state == "succeeded"


# On SIGTERM it takes 4 s to save, then exits; resumed, it says from which checkpoint and ends.
SAVES_IN_4_S = [sys.executable, "-c", SLOW_SAVE[2].replace("time.sleep(13)", "time.sleep(4)")]


def test_a_victim_gets_the_grace_of_the_preemption_not_the_one_it_was_launched_with(stack):
    """The operator raised the grace period after the job started: the stop gives it the new
    one (the agent used to keep the launch's 1 s, killing the save half-way)."""
    s = stack(machines=1, gpus=4, policy={"min_runtime": 0, "grace_period": 1})
    s.submit("slow", 4, SAVES_IN_4_S, priority="low")
    s.until(lambda: "running" in s.log("slow"))
    s.run(s.client.store.configure_cluster("c1", policy={"min_runtime": 0, "grace_period": 20}))
    s.submit("urgent", 4, example_job(steps=1, step_seconds=0.1), priority="critical")
    resumed_from_the_save_in_its_grace(s)
