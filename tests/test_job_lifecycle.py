"""Jobs end to end on the real stack: Temporal, Postgres and SeaweedFS started by the fixtures,
the control worker, the API and machine agents as processes, jobs as real local processes."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from datetime import datetime

import pytest
from temporalio.client import WorkflowFailureError
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError, RPCStatusCode

from live.jobs import sleeper
from scheduler.models import Priority, Quota
from workers import devstack
from workers.client import SubmitRefused
from workers.settings import machine_component
from workflows.types import JOB_FAILED, JobRequest, job_workflow_id, scheduler_workflow_id

pytestmark = pytest.mark.live


def test_a_job_runs_pinned_to_the_gpus_it_was_allocated_and_succeeds(stack):
    s = stack()
    s.submit("pinned", 2, sleeper(0.2))
    view = s.wait("pinned")
    assert view.state == "succeeded" and view.exit_code == 0
    [attempt] = view.attempts
    assert attempt.end_reason == "completed" and attempt.started_at and attempt.ended_at
    ran = next(line for line in s.log("pinned").splitlines() if line.startswith("RAN"))
    _, _, visible, *paths = ran.split()
    assert paths == attempt.gpus
    assert visible.split(",") == [p.rsplit("/", 1)[1] for p in attempt.gpus]
    assert s.sql("SELECT count(*) AS n FROM gpu_holds WHERE upper_inf(held)")[0]["n"] == 0


def test_a_command_that_exits_3_fails_the_job_with_code_3_and_its_last_log_lines(stack):
    s = stack()
    s.submit("three", 1, [sys.executable, "-c", "import sys; print('loss went NaN'); sys.exit(3)"])
    view = s.wait("three")
    assert view.state == "failed" and view.exit_code == 3
    assert "exit code 3" in view.reason and "loss went NaN" in view.reason


# Rank 0 says why, leaves a mark and exits 3; rank 1 runs on until the gang is stopped, or exits 4
# half a second after the mark (after rank 0 whenever either started: the agents start them apart).
GANG_RANK_FAILS = [sys.executable, "-c", (
    "import os, pathlib, sys, time; rank = os.environ['GPUSCHED_NODE_RANK']; mark = pathlib.Path(sys.argv[1])\n"
    "print('RAN rank', rank, flush=True)\n"
    "if rank == '0': time.sleep(1); print('rank 0: loss went NaN', flush=True); mark.touch(); sys.exit(3)\n"
    "if sys.argv[2] == 'runs': time.sleep(600)\n"
    "while not mark.exists(): time.sleep(0.05)\n"
    "time.sleep(0.5); sys.exit(4)")]


@pytest.mark.parametrize("name, rank_1", [
    ("the other rank still running, stopped with the gang", "runs"),
    ("the other rank failing too, after it", "fails"),
])
def test_a_gang_whose_first_machine_fails_fails_with_that_machine_s_exit_code_and_lines(stack, tmp_path, name,
                                                                                      rank_1):
    """The reason's words came from whichever rank was looked at last (a name reused inside the
    look for a rank's word on its checkpoint): a rank stopped with the gang had none, and the
    workflow failed on every replay, holding its GPUs, its job shown running for ever."""
    s = stack(machines=2, gpus=2)
    s.submit("gang", 4, GANG_RANK_FAILS + [str(tmp_path / "rank-0-failed"), rank_1], topology="any")
    view = s.wait("gang", timeout=60)
    assert {g.rsplit("/", 1)[0] for g in view.attempts[0].gpus} == {"c1/b0/r0/m0", "c1/b0/r0/m1"}
    assert view.state == "failed" and view.exit_code == 3, view.reason
    assert "exit code 3" in view.reason and "rank 0: loss went NaN" in view.reason
    assert s.sql("SELECT count(*) AS n FROM gpu_holds WHERE upper_inf(held)")[0]["n"] == 0


def test_a_queued_job_its_cancel_signal_ended_waits_for_the_temporal_cancellation_that_follows_it(stack):
    """`gpusched cancel` signals, then asks Temporal to cancel: a queued job's workflow, ended by
    the signal alone, had completed before that came now and then, and the UI listed it Completed."""
    s = stack(machines=1)
    s.submit("hog", 4, sleeper(60))
    s.submit("waits", 4, sleeper(0))
    s.until(lambda: s.status("hog").state == "running" and s.status("waits").state == "queued")
    handle = s.client._handle("waits")
    s.run(handle.signal("cancel", "not needed any more"))
    s.until(lambda: s.status("waits").state == "cancelled")
    assert s.run(handle.describe()).status.name == "RUNNING"  # the job ended; its workflow waits a moment
    s.run(handle.cancel())
    s.until(lambda: s.run(handle.describe()).status.name != "RUNNING", timeout=30)
    assert s.run(handle.describe()).status.name == "CANCELED"
    s.run(s.client.cancel("hog", "the test is done"))


def test_each_job_workflow_ends_as_its_job_did_so_the_temporal_ui_lists_how_jobs_ended(stack):
    s = stack(machines=1)
    s.submit("fine", 1, sleeper(0))
    s.submit("broken", 1, [sys.executable, "-c", "import sys; sys.exit(3)"])
    s.submit("dropped", 1, sleeper(60))
    s.submit("dropped-early", 4, sleeper(0), priority="low")  # waits behind the others: never runs
    s.until(lambda: s.status("dropped").state == "running")
    for job_id in ("dropped", "dropped-early"):
        s.run(s.client.cancel(job_id, "not needed any more"))
    ends = {j: s.wait(j, timeout=60) for j in ("fine", "broken", "dropped", "dropped-early")}

    async def workflow_status(job_id: str) -> str:
        return (await s.client._handle(job_id).describe()).status.name

    # The store says how a job ended a moment before its workflow has ended (it wakes the scheduler first).
    s.until(lambda: "RUNNING" not in {s.run(workflow_status(j)) for j in ends}, timeout=30)
    assert {j: (v.state, s.run(workflow_status(j))) for j, v in ends.items()} == {
        "fine": ("succeeded", "COMPLETED"), "broken": ("failed", "FAILED"),
        "dropped": ("cancelled", "CANCELED"), "dropped-early": ("cancelled", "CANCELED")}
    # The failure carries the job's reason, and the cancels the reason `gpusched cancel` gave.
    outcome = failed_outcome(s, s.client.temporal.get_workflow_handle(
        s.up.settings.task_queue_prefix + job_workflow_id("broken")))
    assert outcome["state"] == "failed" and "exit code 3" in outcome["reason"] == ends["broken"].reason
    assert ends["dropped"].reason == ends["dropped-early"].reason == "not needed any more"


def test_a_job_with_retries_runs_its_failed_command_again_until_its_retries_are_spent(stack):
    s = stack()
    flaky = "import os, sys; print('NCCL timeout'); sys.exit(3 if os.environ['GPUSCHED_ATTEMPT'] == '1' else 0)"
    s.submit("flaky", 1, [sys.executable, "-c", flaky], max_retries=2)
    s.submit("broken", 1, [sys.executable, "-c", "import sys; sys.exit(3)"], max_retries=1)
    flaky_view, broken = s.wait("flaky"), s.wait("broken")
    assert flaky_view.state == "succeeded"
    assert [a.end_reason for a in flaky_view.attempts] == ["failed", "completed"]
    assert broken.state == "failed" and broken.exit_code == 3
    assert broken.reason == "the command failed with exit code 3 (its retry spent)"  # it wrote no log
    assert [a.end_reason for a in broken.attempts] == ["failed", "failed"]
    requeued = s.sql("SELECT reason FROM audit WHERE job_id = 'broken' AND event = 'requeued'")
    assert len(requeued) == 1 and "exit code 3 (retry 1 of 1)" in requeued[0]["reason"]


def test_a_job_that_exits_75_is_queued_again_without_retries_and_five_in_a_row_fail_it(stack):
    """Exit 75 (jobkit.EXIT_RETRY_LATER): what the job needs is not there now, its checkpoint
    store say. Not the command's own failure, so no retries are needed; but it is no loop either:
    from the second failure in a row it is held back, longer each time (1 s, 2 s, 4 s here)."""
    s = stack(machines=1, policy={"retry_backoff": 1})
    later = "import os, sys; print('store unreachable'); sys.exit(75 if os.environ['GPUSCHED_ATTEMPT'] == '1' else 0)"
    s.submit("later", 1, [sys.executable, "-c", later])
    s.submit("never", 1, [sys.executable, "-c", "import sys; sys.exit(75)"])
    view, never = s.wait("later"), s.wait("never", timeout=90)
    assert view.state == "succeeded" and [a.end_reason for a in view.attempts] == ["machine_failure", "completed"]
    assert never.state == "failed" and len(never.attempts) == 5 and "5 infrastructure failures" in never.reason
    # It says how the command ended, and no empty line stands for the log it did not write.
    assert never.exit_code == 75 and never.reason.endswith("(exit code 75) (5 infrastructure failures)")
    tries = s.sql("SELECT placed_at, ended_at FROM allocations WHERE job_id = 'never' ORDER BY attempt")
    held = [later["placed_at"] - earlier["ended_at"] for earlier, later in zip(tries, tries[1:])]
    assert all(h >= wait - 0.05 for h, wait in zip(held[1:], (1, 2, 4))), held


def test_a_job_ended_by_a_sigterm_while_its_agent_runs_on_is_never_taken_for_done(stack):
    """jobkit's EXIT_STOPPED was 0: a job stopped by a SIGTERM its agent did not send, that saved
    and exited on it, was taken for finished. With its agent running on (the machine is not
    stopping: tests/test_node_activity.py has the agent shutting down), such an end is the
    command's own, as an end by the signal is."""
    s = stack(machines=1)
    s.submit("killed", 1, [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGTERM)"])
    s.submit("saved", 1, [sys.executable, "-c", "import sys; print('saved'); sys.exit(143)"])
    for name, how in (("killed", "signal 15"), ("saved", "exit code 143")):
        view = s.wait(name)
        assert view.state == "failed" and how in view.reason, view.reason
        assert [a.end_reason for a in view.attempts] == ["failed"]


def test_a_queued_job_is_cancelled_without_ever_running(stack):
    s = stack(machines=1)
    s.submit("blocker", 4, sleeper(30))
    s.until(lambda: s.status("blocker").state == "running")
    s.submit("waiting", 4, sleeper(0))
    assert s.status("waiting").state == "queued"
    s.run(s.client.cancel("waiting"))
    view = s.wait("waiting")
    assert view.state == "cancelled" and view.attempts == []
    s.run(s.client.cancel("blocker"))


def test_changing_a_job_that_ended_meanwhile_is_refused_in_words_not_a_traceback(stack, monkeypatch):
    """cancel and bump look at the job, then ask its workflow: a job that ends in between (here:
    the look is made to see it still running) is refused as ended; wait answers from the store."""
    s = stack(machines=1)
    s.submit("quick", 1, sleeper(0))
    ended = s.wait("quick")
    assert ended.state == "succeeded"
    from workers.client import ClientError, GpuschedClient

    real_status = GpuschedClient.status

    async def still_running(self, job_id):
        view = await real_status(self, job_id)
        return view.model_copy(update={"state": "running"}) if job_id == "quick" else view

    monkeypatch.setattr(GpuschedClient, "status", still_running)
    for change, words in ((s.client.cancel("quick"), "has already ended"),
                          (s.client.bump("quick", Priority.critical), "cannot change the priority")):
        with pytest.raises(ClientError) as refused:
            s.run(change)
        assert words in str(refused.value), str(refused.value)
    monkeypatch.setattr(GpuschedClient, "status", real_status)
    assert s.wait("quick").state == "succeeded"


def test_a_running_job_is_cancelled_its_process_stopped_and_its_gpus_freed(stack):
    s = stack(machines=1)
    pid_file = s.data_dir / "victim.pid"
    s.submit("victim", 4, [sys.executable, "-c",
                           f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(60)"])
    s.until(lambda: pid_file.exists() and pid_file.read_text())
    pid = int(pid_file.read_text())
    s.run(s.client.cancel("victim"))
    view = s.wait("victim", timeout=30)
    assert view.state == "cancelled" and view.attempts[0].end_reason == "cancelled"
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert s.sql("SELECT count(*) AS n FROM gpu_holds WHERE upper_inf(held)")[0]["n"] == 0
    s.submit("next", 4, sleeper(0))
    assert s.wait("next").state == "succeeded"


# Takes 5 s to checkpoint once told to stop; writes the file it is given once it listens.
SLOW_TO_STOP = [sys.executable, "-c", (
    "import pathlib, signal, sys, time\n"
    "signal.signal(signal.SIGTERM, lambda *_: (time.sleep(5), sys.exit(0)))\n"
    "pathlib.Path(sys.argv[1]).write_text('listening')\n"
    "time.sleep(120)")]


def test_a_running_job_being_cancelled_says_its_attempt_is_stopping_and_when_its_grace_ends(stack):
    """It showed only `running` while it checkpointed."""
    s = stack(machines=1)
    listening = s.data_dir / "slow.listening"
    s.submit("slow", 4, [*SLOW_TO_STOP, str(listening)])
    s.until(listening.exists)
    s.run(s.client.cancel("slow", "cancelled by alice: wrong data"))
    s.until(lambda: s.status("slow").attempts[0].stopping is not None)
    view = s.status("slow")
    assert view.state == "running" and view.attempts[0].stopping == "cancelled by alice: wrong data"
    assert datetime.fromisoformat(view.attempts[0].stop_by).timestamp() > time.time() + 30
    view = s.wait("slow", timeout=30)
    assert view.state == "cancelled" and view.attempts[0].stopping is None


def test_a_cancellation_asked_of_temporal_cancels_the_job_like_gpusched_cancel(stack):
    """The Temporal UI's "Request Cancellation" (or `temporal workflow cancel`): the running job is
    stopped with its grace and the queued one never runs; both end cancelled, in the store and in
    their search attributes, and the GPUs come back at once (not a minute later, as failed)."""
    s = stack(machines=1)
    s.submit("ran", 4, sleeper(60))
    s.until(lambda: s.status("ran").state == "running")
    s.submit("queued", 4, sleeper(0))
    assert s.status("queued").state == "queued"
    for job_id in ("queued", "ran"):
        s.run(s.client._handle(job_id).cancel())
    for job_id in ("queued", "ran"):
        view = s.wait(job_id, timeout=30)
        assert view.state == "cancelled" and "cancelled from Temporal" in view.reason, view
    assert s.status("ran").attempts[0].end_reason == "cancelled" and s.status("queued").attempts == []
    assert s.sql("SELECT count(*) AS n FROM gpu_holds WHERE upper_inf(held)")[0]["n"] == 0

    async def job_state(job_id: str) -> str:
        described = await s.client._handle(job_id).describe()
        return described.search_attributes["JobState"][0]

    assert [s.run(job_state(j)) for j in ("queued", "ran")] == ["Cancelled", "Cancelled"]


def test_the_design_s_query_finds_a_running_job_by_its_state_and_team(stack):
    """`temporal workflow list --query "JobState='Running' AND Team='vision'"` (docs/live.md): the
    state is published as that query writes it, and the query finds the job and no other."""
    s = stack(machines=1)
    s.run(s.client.set_quota("speech", Quota(guaranteed=4, max=8)))
    s.submit("listed", 1, sleeper(60))
    s.submit("elsewhere", 1, sleeper(60), team="speech")
    s.until(lambda: {s.status("listed").state, s.status("elsewhere").state} == {"running"})
    prefix = s.up.settings.task_queue_prefix

    async def found(query: str) -> list[str]:
        return sorted([w.id async for w in s.client.temporal.list_workflows(f"{query} AND WorkflowId STARTS_WITH '{prefix}'")])

    s.until(lambda: s.run(found("JobState='Running' AND Team='vision'")) == [prefix + job_workflow_id("listed")], timeout=15)
    for job_id in ("listed", "elsewhere"):
        s.run(s.client.cancel(job_id))
        s.wait(job_id)
    s.until(lambda: len(s.run(found("JobState='Cancelled'"))) == 2, timeout=15)


def test_a_priority_bump_moves_a_job_ahead_in_the_queue(stack):
    s = stack(machines=2)
    # "short" ends when the bump has been seen (not after a fixed time, which a slow machine
    # could spend before the bump, and the low jobs would start in their first order).
    s.submit("short", 4, sleeper(60))
    s.submit("long", 4, sleeper(60))
    s.until(lambda: {s.status("short").state, s.status("long").state} == {"running"})
    s.submit("first-low", 4, sleeper(0), priority="low")
    s.submit("second-low", 4, sleeper(0), priority="low")
    s.until(lambda: s.status("second-low").position == 2)
    s.run(s.client.bump("second-low", Priority.high))
    s.until(lambda: s.status("second-low").position == 1)
    s.run(s.client.cancel("short"))
    # "long" holds the other machine throughout, so the two share one machine, one after the other.
    bumped, other = s.wait("second-low"), s.wait("first-low")
    assert bumped.state == other.state == "succeeded"
    assert bumped.attempts[0].ended_at <= other.attempts[0].started_at
    s.run(s.client.cancel("long"))


def test_twenty_jobs_on_two_machines_all_succeed_and_never_share_a_gpu(stack):
    s = stack(machines=2, gpus=4)
    sizes = [1, 2, 4, 3, 1, 2, 2, 4, 1, 3, 2, 1, 4, 2, 3, 1, 2, 4, 1, 2]
    for i, gpus in enumerate(sizes):
        s.submit(f"j{i:02d}", gpus, sleeper(0.3 + (i % 3) * 0.2))
    views = [s.wait(f"j{i:02d}", timeout=120) for i in range(len(sizes))]
    assert [v.state for v in views] == ["succeeded"] * len(sizes)
    overlaps = s.sql("""SELECT count(*) AS n FROM gpu_holds a JOIN gpu_holds b
                        ON a.machine_id = b.machine_id AND a.idx = b.idx
                        AND a.allocation_id < b.allocation_id AND a.held && b.held""")
    assert overlaps[0]["n"] == 0
    # The same from the processes' side: per GPU, the intervals the commands really ran.
    spans: dict[str, list[tuple[float, float]]] = {}
    for v in views:
        lines = s.log(v.job_id).splitlines()
        ran = next(line.split() for line in lines if line.startswith("RAN"))
        done = next(line.split() for line in lines if line.startswith("DONE"))
        for path in ran[3:]:
            spans.setdefault(path, []).append((float(ran[1]), float(done[1])))
    for path, intervals in spans.items():
        intervals.sort()
        assert all(a[1] <= b[0] for a, b in zip(intervals, intervals[1:])), path


def test_killing_the_control_worker_mid_run_loses_nothing_and_runs_nothing_twice(stack):
    s = stack(machines=2, gpus=4)
    for i in range(2):
        s.submit(f"running{i}", 4, sleeper(6))
    s.until(lambda: all(s.status(f"running{i}").state == "running" for i in range(2)))
    for i in range(2):
        s.submit(f"queued{i}", 4, sleeper(0.5))
    devstack.stop_component(s.data_dir, "control", signal.SIGKILL)
    time.sleep(1)
    devstack.start_component(s.data_dir, "control")
    views = [s.wait(j, timeout=90) for j in ("running0", "running1", "queued0", "queued1")]
    assert [v.state for v in views] == ["succeeded"] * 4
    assert [len(v.attempts) for v in views] == [1] * 4
    for v in views:
        assert s.log(v.job_id).count("RAN ") == 1
        assert not s.log(v.job_id, attempt=2)


def test_the_scheduler_loop_continues_as_new_while_jobs_flow(stack):
    s = stack(machines=1, gpus=4, control_args=["--cycles-per-run", "3"])
    for i in range(6):
        s.submit(f"flow{i}", 4, sleeper(0.3))
    views = [s.wait(f"flow{i}", timeout=90) for i in range(6)]
    assert [v.state for v in views] == ["succeeded"] * 6
    prefix = s.up.settings.task_queue_prefix
    scheduler_id = prefix + scheduler_workflow_id("c1")

    async def runs() -> list:
        return [w async for w in s.client.temporal.list_workflows(f"WorkflowId = '{scheduler_id}'")]

    def one_running_after_two_continued() -> list | None:
        """Read until it holds: the list is Temporal's visibility, written after each run closes
        and the next starts, so a read in between (every three cycles here) shows no run running."""
        statuses = [e.status.name for e in s.run(runs())]
        return statuses if statuses.count("CONTINUED_AS_NEW") >= 2 and statuses.count("RUNNING") == 1 else None

    statuses = s.until(one_running_after_two_continued)
    assert set(statuses) <= {"CONTINUED_AS_NEW", "RUNNING"}  # no run failed, timed out or was terminated


def test_a_control_worker_started_with_other_flags_gives_them_to_the_loop_that_runs(stack):
    """--tick and --cycles-per-run reached only a loop the worker started: one that ran already
    (it outlives the worker) kept the first run's settings for good, through continue-as-new."""
    s = stack(machines=1, gpus=4)
    loop = s.client.temporal.get_workflow_handle(s.up.settings.task_queue_prefix + scheduler_workflow_id("c1"))
    assert s.run(loop.query("status"))["cycles_per_run"] == 500
    devstack.up(s.data_dir, control_args=["--tick", "0.25", "--cycles-per-run", "4"])
    settled = s.until(lambda: (lambda st: st if st["cycles_per_run"] == 4 else None)(s.run(loop.query("status"))))
    assert settled["tick_seconds"] == 0.25
    # Carried on by continue-as-new: run after run is 4 cycles long (at 0.25 s a cycle when idle).
    scheduler_id = s.up.settings.task_queue_prefix + scheduler_workflow_id("c1")

    async def continued() -> int:
        return sum([1 async for w in s.client.temporal.list_workflows(f"WorkflowId = '{scheduler_id}'")
                    if w.status.name == "CONTINUED_AS_NEW"])

    s.until(lambda: s.run(continued()) >= 3, timeout=30)
    assert s.run(loop.query("status"))["cycles_per_run"] == 4


def test_a_submit_for_a_team_without_a_quota_is_refused_and_starts_no_workflow(stack):
    s = stack(machines=1)
    with pytest.raises(SubmitRefused, match="has no quota"):
        s.run(s.client.submit(JobRequest(job_id="orphan", team="nobody", num_gpus=1, command=["true"])))
    handle = s.client.temporal.get_workflow_handle(s.up.settings.task_queue_prefix + job_workflow_id("orphan"))
    with pytest.raises(RPCError) as none:
        s.run(handle.describe())
    assert none.value.status == RPCStatusCode.NOT_FOUND


def test_a_job_id_already_taken_running_or_ended_is_refused_naming_the_field(stack):
    s = stack(machines=1)
    s.submit("taken", 1, sleeper(2))
    again = JobRequest(job_id="taken", team="vision", num_gpus=1, command=["true"])
    with pytest.raises(SubmitRefused, match="already exists") as running:
        s.run(s.client.submit(again))
    assert s.wait("taken", timeout=60).state == "succeeded"
    with pytest.raises(SubmitRefused, match="already exists") as ended:
        s.run(s.client.submit(again))
    assert running.value.field == ended.value.field == "job_id"
    assert len(s.status("taken").attempts) == 1


def test_the_same_submit_sent_again_under_its_id_is_that_job_not_a_refusal_nor_a_second_one(stack):
    """A client whose first answer was lost (or came too late) sends the same request again."""
    s = stack(machines=1)
    request = JobRequest(job_id="retried", team="vision", num_gpus=1, command=sleeper(1))
    first = s.run(s.client.submit(request))
    again = s.run(s.client.submit(request))
    assert (again.job_id, again.cluster) == (first.job_id, first.cluster)
    assert s.wait("retried").state == "succeeded" and len(s.status("retried").attempts) == 1
    # Sent again once the job has ended, it says so: not "placed, starting now".
    ended = s.run(s.client.submit(request))
    assert (ended.state, ended.position, ended.estimated_start) == ("succeeded", None, None)
    assert len(s.status("retried").attempts) == 1


def test_the_same_submit_sent_again_after_a_priority_bump_is_still_that_job(stack):
    s = stack(machines=1)
    s.submit("hog", 4, sleeper(60))
    s.until(lambda: s.status("hog").state == "running")
    request = JobRequest(job_id="bumped", team="vision", num_gpus=4, command=sleeper(0), priority="low")
    s.run(s.client.submit(request))
    s.run(s.client.bump("bumped", Priority.normal))
    again = s.run(s.client.submit(request))
    assert again.job_id == "bumped" and s.status("bumped").priority == "normal"
    s.run(s.client.cancel("hog"))
    assert s.wait("bumped").state == "succeeded" and len(s.status("bumped").attempts) == 1


def test_an_ended_jobs_id_is_refused_after_temporal_has_forgotten_its_workflow(stack):
    """Past the namespace's retention Temporal no longer refuses the id: the store must, before
    the submit answers, or a new job would be reported accepted and never run."""
    from temporalio.api.common.v1 import WorkflowExecution
    from temporalio.api.workflowservice.v1 import DeleteWorkflowExecutionRequest

    s = stack(machines=1)
    s.submit("reused", 1, sleeper(0))
    assert s.wait("reused").state == "succeeded"
    settings = s.up.settings
    s.run(s.client.temporal.workflow_service.delete_workflow_execution(DeleteWorkflowExecutionRequest(
        namespace=settings.temporal_namespace,
        workflow_execution=WorkflowExecution(workflow_id=settings.task_queue_prefix + job_workflow_id("reused")))))
    s.until(lambda: _gone(s, "reused"), timeout=120)
    with pytest.raises(SubmitRefused, match="already exists") as refused:
        s.run(s.client.submit(JobRequest(job_id="reused", team="vision", num_gpus=2, command=["true"])))
    assert refused.value.field == "job_id"
    assert s.status("reused").state == "succeeded" and len(s.status("reused").attempts) == 1


def _gone(s, job_id: str) -> bool:
    """Whether Temporal no longer keeps the job's workflow (any other error: asked again)."""
    try:
        s.run(s.client._handle(job_id).describe())
    except RPCError as e:
        return e.status == RPCStatusCode.NOT_FOUND
    return False


def failed_outcome(s, handle) -> dict:
    """The outcome of a job workflow that failed because its job did: the failure's details."""
    with pytest.raises(WorkflowFailureError) as ended:
        s.run(asyncio.wait_for(handle.result(), 30))
    cause = ended.value.cause
    assert isinstance(cause, ApplicationError) and cause.type == JOB_FAILED and cause.non_retryable
    [outcome] = cause.details
    assert outcome["reason"] == cause.message
    return outcome


def test_a_job_workflow_started_directly_with_a_bad_spec_ends_at_once_with_the_reason(stack):
    s = stack(machines=1)
    prefix = s.up.settings.task_queue_prefix
    bad = JobRequest(job_id="direct", team="vision", num_gpus=64, command=["true"])  # 64 > 4 per machine
    handle = s.run(s.client.temporal.start_workflow(
        "JobWorkflow", bad, id=prefix + job_workflow_id("direct"), task_queue=prefix + "gpusched-control"))
    outcome = failed_outcome(s, handle)
    assert outcome["state"] == "failed" and "refused" in outcome["reason"]
    # The id stays taken (an id names one job for good), and a later submit is told why.
    with pytest.raises(SubmitRefused, match="was used by a submit that was refused .*num_gpus|GPUs") as again:
        s.run(s.client.submit(JobRequest(job_id="direct", team="vision", num_gpus=1, command=["true"])))
    assert again.value.field == "job_id" and "choose another id" in str(again.value)


def test_a_job_whose_agent_dies_is_requeued_when_its_heartbeat_lapses_and_runs_elsewhere(stack):
    s = stack(machines=2, gpus=4)
    s.run(s.client.store.configure_cluster("c1", machine_timeout=3))
    s.submit("survivor", 4, sleeper(4))
    s.until(lambda: s.status("survivor").state == "running")
    first_machine = s.status("survivor").attempts[0].gpus[0].rsplit("/", 1)[0]
    devstack.stop_component(s.data_dir, machine_component(first_machine), signal.SIGKILL)
    view = s.wait("survivor", timeout=90)
    assert view.state == "succeeded"
    assert [a.end_reason for a in view.attempts] == ["machine_failure", "completed"]
    assert view.attempts[1].gpus[0].rsplit("/", 1)[0] != first_machine


def test_the_workflows_histories_replay_deterministically(stack):
    from temporalio.contrib.pydantic import pydantic_data_converter
    from temporalio.worker import Replayer

    from workflows.cluster import ClusterSchedulerWorkflow
    from workflows.job import JobWorkflow

    s = stack(machines=1)
    s.submit("replayed", 2, sleeper(0.2))
    s.submit("cancelled", 4, sleeper(30))
    assert s.wait("replayed").state == "succeeded"
    assert s.status("cancelled").state in ("queued", "placed", "running"), (
        s.run(s.client.store.audit_trail("replayed")), s.run(s.client.store.audit_trail("cancelled")))
    s.run(s.client.cancel("cancelled"))
    s.wait("cancelled")
    prefix = s.up.settings.task_queue_prefix
    replayer = Replayer(workflows=[JobWorkflow, ClusterSchedulerWorkflow], data_converter=pydantic_data_converter)
    for workflow_id in (job_workflow_id("replayed"), job_workflow_id("cancelled"), scheduler_workflow_id("c1")):
        history = s.run(s.client.temporal.get_workflow_handle(prefix + workflow_id).fetch_history())
        s.run(replayer.replay_workflow(history))
        if workflow_id.startswith("job-"):
            # As a workflow from before the JobState attribute was capitalised recorded it: the
            # new code replays it (the attribute's change is not behind a patch).
            assert _state_attributes_lowercased(history) > 0
            s.run(replayer.replay_workflow(history))


def _state_attributes_lowercased(history) -> int:
    """Rewrite the history's JobState upserts to the lowercase values; how many there were."""
    count = 0
    for event in history.events:
        if event.HasField("upsert_workflow_search_attributes_event_attributes"):
            fields = event.upsert_workflow_search_attributes_event_attributes.search_attributes.indexed_fields
            if "JobState" in fields:
                fields["JobState"].data = fields["JobState"].data.lower()
                count += 1
    return count


def test_a_job_workflow_started_under_an_id_of_its_own_is_refused_naming_the_id_it_needs(stack):
    s = stack(machines=1)
    prefix = s.up.settings.task_queue_prefix
    request = JobRequest(job_id="mine", team="vision", num_gpus=1, command=["true"])
    handle = s.run(s.client.temporal.start_workflow(
        "JobWorkflow", request, id=prefix + "pipeline-step-7", task_queue=prefix + "gpusched-control"))
    outcome = failed_outcome(s, handle)
    assert outcome["state"] == "failed" and prefix + job_workflow_id("mine") in outcome["reason"]
    s.submit("mine", 1, sleeper(0))  # the id was not taken: the refused start left no job
    assert s.wait("mine").state == "succeeded"


@pytest.mark.parametrize("raw, words", [
    ({"job_id": "zero", "team": "vision", "num_gpus": 0, "command": ["true"]}, "num_gpus"),
    ({"job_id": "nocmd", "team": "vision", "num_gpus": 1, "command": []}, "command"),
    ({"team": "vision", "num_gpus": 1, "command": ["true"]}, "job_id"),
])
def test_a_job_workflow_started_with_a_request_that_does_not_parse_ends_at_once(stack, raw, words):
    s = stack(machines=1)
    prefix = s.up.settings.task_queue_prefix
    handle = s.run(s.client.temporal.start_workflow(
        "JobWorkflow", raw, id=f"{prefix}job-raw-{words}", task_queue=prefix + "gpusched-control"))
    outcome = failed_outcome(s, handle)
    assert outcome["state"] == "failed" and words in outcome["reason"]
    # Named as the input named it, and found by `JobState='Failed'` like any refused job.
    assert outcome["job_id"] == raw.get("job_id", f"{prefix}job-raw-{words}")
    assert s.run(handle.describe()).search_attributes["JobState"] == ["Failed"]


def test_a_job_whose_workflow_is_terminated_gives_its_placement_back(stack):
    s = stack(machines=1, gpus=4)
    s.submit("blocker", 4, sleeper(60))  # cancelled once "doomed" is terminated, not ended by a clock
    s.until(lambda: s.status("blocker").state == "running")
    s.submit("doomed", 4, sleeper(0))
    s.submit("after", 4, sleeper(0))
    handle = s.client.temporal.get_workflow_handle(s.up.settings.task_queue_prefix + job_workflow_id("doomed"))
    s.run(handle.terminate("an operator terminated it"))
    s.run(s.client.cancel("blocker"))
    assert s.wait("after", timeout=60).state == "succeeded"
    doomed = s.status("doomed")
    assert doomed.state == "failed" and "workflow ended" in doomed.reason
    assert s.sql("SELECT count(*) AS n FROM gpu_holds WHERE upper_inf(held)")[0]["n"] == 0


def test_a_job_whose_workflow_is_terminated_while_it_runs_gives_its_gpus_back_when_stopped(stack):
    s = stack(machines=1, gpus=4, policy={"min_runtime": 0, "grace_period": 5})
    s.submit("doomed", 4, sleeper(60), priority="low")
    s.until(lambda: s.status("doomed").state == "running")
    handle = s.client.temporal.get_workflow_handle(s.up.settings.task_queue_prefix + job_workflow_id("doomed"))
    s.run(handle.terminate("an operator terminated it"))
    s.submit("urgent", 4, sleeper(0), priority="critical")  # its stop order reaches no workflow
    assert s.wait("urgent", timeout=60).state == "succeeded"
    view = s.status("doomed")
    assert view.state == "failed" and "workflow ended while the job ran" in view.reason
    assert view.attempts[0].end_reason == "cancelled"


def test_a_job_whose_workflow_is_terminated_while_it_runs_has_its_gpus_back_though_nobody_asks(stack):
    s = stack(machines=1, gpus=4, control_args=["--reconcile-every", "1"])
    s.submit("forgotten", 4, sleeper(120))
    s.until(lambda: s.status("forgotten").state == "running")
    handle = s.client.temporal.get_workflow_handle(s.up.settings.task_queue_prefix + job_workflow_id("forgotten"))
    s.run(handle.terminate("an operator terminated it"))
    s.until(lambda: s.status("forgotten").state == "failed", timeout=30)
    assert "workflow ended while the job ran" in s.status("forgotten").reason
    s.submit("next", 4, sleeper(0))
    assert s.wait("next", timeout=60).state == "succeeded"


def test_a_queued_job_whose_workflow_is_terminated_leaves_the_queue_though_it_is_never_placed(stack):
    s = stack(machines=1, gpus=4, control_args=["--reconcile-every", "1"])
    s.submit("blocker", 4, sleeper(120))
    s.until(lambda: s.status("blocker").state == "running")
    s.submit("forgotten", 4, sleeper(0), priority="critical")  # would preempt the blocker, were it placed
    s.until(lambda: s.status("forgotten").state == "queued")
    handle = s.client.temporal.get_workflow_handle(s.up.settings.task_queue_prefix + job_workflow_id("forgotten"))
    s.run(handle.terminate("an operator terminated it"))
    s.until(lambda: s.status("forgotten").state == "failed", timeout=30)
    view = s.status("forgotten")
    assert "workflow ended while the job was queued" in view.reason and view.attempts == []
    blocker = s.status("blocker")
    assert blocker.state == "running" and len(blocker.attempts) == 1


def test_a_submit_no_control_worker_admits_in_time_is_not_refused_and_runs_once_one_does(stack, monkeypatch, capsys):
    s = stack(machines=1)
    from workers.cli import main
    from workers.client import GpuschedClient

    devstack.stop_component(s.data_dir, "control")
    monkeypatch.setattr(GpuschedClient, "ADMIT_WAIT", 1.0)
    argv = ["submit", "--team", "vision", "--gpus", "1", "--job-id", "patient", "--data-dir", str(s.data_dir),
            "--", *sleeper(0)]
    for _ in range(2):  # the same submit sent again while it waits is that job, not a refusal
        code = main(argv)
        err = capsys.readouterr().err
        assert code == 1 and "not admitted within 1 s" in err and "gpusched status patient" in err, err
    # What the submit said: status follows it (not "no job"), and a cancel sent now is not lost.
    assert main(["status", "patient", "--data-dir", str(s.data_dir)]) == 1
    assert "patient is submitted but not admitted yet" in capsys.readouterr().err
    argv[argv.index("patient")] = "unwanted"
    assert main(argv) == 1
    assert main(["cancel", "unwanted", "--data-dir", str(s.data_dir)]) == 0
    assert "ends cancelled as soon as one admits it" in capsys.readouterr().out
    devstack.start_component(s.data_dir, "control")
    s.until(lambda: s.sql("SELECT 1 FROM jobs WHERE id = 'patient'"), timeout=30)
    assert s.wait("patient", timeout=60).state == "succeeded" and len(s.status("patient").attempts) == 1
    unwanted = s.wait("unwanted", timeout=60)
    # Never ran: a cycle may place it between its admission and the cancel, but nothing launches.
    assert unwanted.state == "cancelled" and all(a.started_at is None for a in unwanted.attempts)

