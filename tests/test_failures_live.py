"""Failures on the real stack: a machine's agent dies and comes back, a GPU goes bad. No job is
lost, none runs twice, and a zombie's checkpoint is never committed."""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import textwrap
import time

import pytest

from live.jobs import Stack, example_job, sleeper
from workers import devices, devstack
from workers.servers import pid_alive
from workers.settings import agent_log_dir, machine_component

pytestmark = pytest.mark.live

HEARTBEAT_TIMEOUT = 10.0  # workflows.job.AGENT_HEARTBEAT
# Longer than the job's heartbeat timeout, as in production (120 s): the job is requeued while its
# dead machine still counts as reachable, and empty, so only the machine's owing an answer keeps
# the job from going straight back to it.
MACHINE_TIMEOUT = 60.0


def machine_of(gpu_path: str) -> str:
    return gpu_path.rsplit("/", 1)[0]


def test_a_dead_agent_whose_machine_leaves_the_stack_does_not_leave_its_job_running(stack):
    """`dev up` with fewer machines dropped the record of an agent that had died, and with it the
    only way `down` found the job it left: that job ran on beside its requeued self, past `down`."""
    s = stack(machines=2, gpus=4)
    s.submit("filler", 4, sleeper(300))
    s.until(lambda: s.status("filler").state == "running")
    s.submit("orphan", 4, sleeper(300))
    s.until(lambda: s.status("orphan").state == "running")
    attempt = s.status("orphan").attempts[0]
    assert machine_of(attempt.gpus[0]) == "c1/b0/r0/m1"  # the machine `--machines 1` drops
    pid_files = f"jobs/*/.pids/*/{attempt.allocation_id}.json"
    s.until(lambda: list(s.data_dir.glob(pid_files)))
    pid = json.loads(next(s.data_dir.glob(pid_files)).read_text())["pid"]
    devstack.stop_component(s.data_dir, machine_component("c1/b0/r0/m1"), signal.SIGKILL)
    assert pid_alive(pid)  # its job runs on, in a session of its own
    devstack.up(s.data_dir, machines=1)
    assert not pid_alive(pid)


def test_a_dead_agents_job_resumes_elsewhere_from_its_last_checkpoint_and_the_returning_agent_kills_the_zombie(stack):
    s = stack(machines=2, gpus=4, policy={"min_runtime": 0, "grace_period": 5}, machine_timeout=MACHINE_TIMEOUT)
    s.submit("durable", 4, example_job(steps=60, step_seconds=0.2), checkpoint_interval=1)
    s.until(lambda: any(c.complete for c in s.status("durable").checkpoints), timeout=30)
    attempt = s.status("durable").attempts[0]
    machine = machine_of(attempt.gpus[0])
    pid_file = next(s.data_dir.glob(f"jobs/*/.pids/*/{attempt.allocation_id}.json"))
    orphan = json.loads(pid_file.read_text())["pid"]

    devstack.stop_component(s.data_dir, machine_component(machine), signal.SIGKILL)
    killed = time.monotonic()
    s.until(lambda: len(s.status("durable").attempts) == 2 and s.status("durable").state == "running", timeout=60)
    moved_in = time.monotonic() - killed
    view = s.status("durable")
    second = view.attempts[1]
    assert view.attempts[0].end_reason == "machine_failure"
    assert machine_of(second.gpus[0]) != machine
    assert second.resumed_from == max(c.seq for c in view.checkpoints if c.complete and c.allocation_id
                                      == attempt.allocation_id)
    # Moved by the job's heartbeat timeout (10 s), plus the end, a cycle and the launch: well
    # before the machine timeout (60 s) would have it (a slow machine has 25 s for the rest).
    assert moved_in <= HEARTBEAT_TIMEOUT + 25 < MACHINE_TIMEOUT - 20, moved_in
    assert pid_alive(orphan)  # nobody could stop it while its agent was dead: a zombie writer
    s.until(lambda: list(s.data_dir.glob(f"jobs/{machine_component(machine)}/durable/reports-1/checkpoint-*.json"))
            and _unanswered(s.data_dir, machine), timeout=20)

    devstack.up(s.data_dir)  # the agent comes back: it kills the orphan before taking work
    s.until(lambda: not pid_alive(orphan), timeout=20)
    refused = s.until(lambda: [c for c in s.status("durable").checkpoints
                               if c.allocation_id == attempt.allocation_id and not c.complete], timeout=20)
    assert "no longer the job's current one" in refused[0].reason
    final = s.wait("durable", timeout=90)
    assert final.state == "succeeded" and len(final.attempts) == 2
    log = s.log("durable", attempt=2)
    assert f"resumed from seq {second.resumed_from}" in log and "final_state=" in log


def _unanswered(data_dir, machine) -> bool:
    reports = agent_log_dir(data_dir, machine) / "durable" / "reports-1"
    return any(not p.with_name(p.name[:-5] + ".ack.json").exists()
               for p in reports.glob("checkpoint-*.json") if not p.name.endswith(".ack.json"))


def test_an_unhealthy_gpu_leaves_the_inventory_alone_and_its_job_moves_with_a_checkpoint(stack):
    s = stack(machines=2, gpus=4, policy={"min_runtime": 0, "grace_period": 10})
    s.submit("sick", 2, example_job(steps=40, step_seconds=0.2), checkpoint_interval=60)
    s.until(lambda: re.search(r"^step 3/40", s.log("sick"), re.M))
    first = s.status("sick").attempts[0]
    bad = first.gpus[1]
    machine, index = machine_of(bad), int(bad.rsplit("/", 1)[1])
    devices.inject_fault(s.data_dir / "faults" / f"{machine_component(machine)}.json", index,
                         devices.ECC_UNCORRECTABLE)
    s.until(lambda: len(s.status("sick").attempts) == 2 and s.status("sick").attempts[1].started_at, timeout=60)
    view = s.status("sick")
    assert view.attempts[0].end_reason == "machine_failure"
    assert bad not in view.attempts[1].gpus
    assert view.attempts[1].resumed_from is not None  # it checkpointed in its grace period
    snapshot = s.run(s.client.store.snapshot("c1"))
    health = {m.id: (m.reachable, set(m.unhealthy_gpus)) for m in snapshot.machines}
    assert health[machine] == (True, {index})  # only the GPU left; its machine stays
    assert s.sql("SELECT preemptions FROM jobs WHERE id = 'sick'")[0]["preemptions"] == []
    # The machine's other three GPUs still take work.
    s.submit("neighbour", 3, example_job(steps=1, step_seconds=0.1), topology="machine")
    assert s.wait("sick", timeout=90).state == "succeeded"
    neighbour = s.wait("neighbour", timeout=60)
    assert neighbour.state == "succeeded" and bad not in neighbour.attempts[0].gpus


def test_a_job_that_dies_as_its_gpu_fails_is_requeued_off_that_gpu_instead_of_failed(stack):
    s = stack(machines=2, gpus=4, policy={"min_runtime": 0})
    # The first attempt's GPU fails under it (an XID, as the fake device reports it) and the
    # process dies of it at once, long before any heartbeat could move the job.
    dies_with_its_gpu = f"""
import os, pathlib, sys
from workers import devices
from workers.settings import machine_component
if os.environ["GPUSCHED_ATTEMPT"] == "1":
    faults = pathlib.Path({str(s.data_dir / "faults")!r}) / (machine_component(os.environ["GPUSCHED_MACHINE_ID"]) + ".json")
    devices.inject_fault(faults, int(os.environ["CUDA_VISIBLE_DEVICES"].split(",")[0]), "xid:79")
    print("CUDA error: unspecified launch failure", flush=True)
    sys.exit(1)
print("ran on", os.environ["GPUSCHED_GPUS"])
"""
    s.submit("crash", 2, [sys.executable, "-c", dies_with_its_gpu])
    view = s.wait("crash", timeout=60)
    assert view.state == "succeeded" and view.exit_code == 0
    first, second = view.attempts
    bad = first.gpus[0]
    assert first.end_reason == "machine_failure" and bad not in second.gpus
    assert f"gpu_faults=GPU {bad.rsplit('/', 1)[1]}: xid:79" in s.log("crash", attempt=1)
    snapshot = s.run(s.client.store.snapshot("c1"))
    assert int(bad.rsplit("/", 1)[1]) in next(m.unhealthy_gpus for m in snapshot.machines
                                               if m.id == machine_of(bad))


def test_a_control_plane_that_could_not_hear_for_a_while_takes_no_machine_for_dead(stack):
    # The timeout must leave room for the break to show first: a heartbeat interval (2 s), the
    # listening refresh (1 s) and its gap (3 s). Production's is 120 s.
    timeout = 8.0
    s = stack(machines=2, gpus=4, policy={"min_runtime": 0}, machine_timeout=timeout)
    s.submit("long", 4, sleeper(3 * timeout + 10))
    s.until(lambda: s.status("long").state == "running", timeout=30)
    # Down for several machine timeouts: no heartbeat is heard, though every agent is well.
    devstack.stop_component(s.data_dir, "api", signal.SIGKILL)
    time.sleep(2.5 * timeout)
    devstack.start_component(s.data_dir, "api")
    time.sleep(timeout)  # heard again: the machines report, and cycles run
    view = s.wait("long", timeout=60)
    assert view.state == "succeeded" and len(view.attempts) == 1, [a.end_reason for a in view.attempts]
    assert all(m.reachable for m in s.run(s.client.store.snapshot("c1")).machines)


@pytest.mark.parametrize("name, also_down", [
    ("Temporal alone: the agents were heard all along", []),
    ("the API down with it, back after Temporal: the control plane heard nobody when the watches timed out",
     ["api"]),
])
def test_jobs_run_on_through_a_temporal_outage_longer_than_their_heartbeat_timeout(tmp_path, name, also_down):
    """Temporal down (restarted, unreachable) for longer than the jobs' heartbeat timeout, while
    their agents live: their watches time out, and each workflow watches its process again
    instead of requeueing it, once the control plane can tell that it hears the machines. Before,
    every running job of the fleet lost its work since its last checkpoint and restarted (and,
    until the workflow waited for the control plane to hear, so did every job of an outage that
    took the API or Postgres down with Temporal). This test runs its own servers, to kill them."""
    data_dir = tmp_path / "stack"
    try:
        s = Stack(devstack.up(data_dir, machines=1, gpus_per_machine=2, fast=True, ui=False, fake_devices=True,
                              control_args=["--tick", "0.5"]))
        s.submit("steady", 1, example_job(60, 0.5), checkpoint_interval=2)
        s.submit("gang-of-one", 1, sleeper(35))
        # Running by the store's word is not enough: an agent whose task was lost with Temporal
        # never started the process, and the job is rightly requeued. Both must have printed.
        s.until(lambda: "starting at step" in s.log("steady") and "RAN" in s.log("gang-of-one"), timeout=60)
        for component in ["temporal", *also_down]:
            devstack.stop_component(data_dir, component, signal.SIGKILL)
        time.sleep(HEARTBEAT_TIMEOUT + 4)
        devstack.start_component(data_dir, "temporal")
        if also_down:
            time.sleep(12)  # the watches have timed out, and the workflows found nobody heard
            for component in also_down:
                devstack.start_component(data_dir, component)
        views = [s.wait(j, timeout=120) for j in ("steady", "gang-of-one")]
        assert [(v.state, len(v.attempts)) for v in views] == [("succeeded", 1)] * 2, \
            [(v.state, [a.end_reason for a in v.attempts]) for v in views]
        assert "starting at step 0 (fresh)" in s.log("steady") and "done, steps=60" in s.log("steady")
        assert "DONE" in s.log("gang-of-one")
    finally:
        if "s" in locals():
            s.close()
        devstack.down(data_dir)


IGNORES_SIGTERM = [sys.executable, "-c",
                   "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('RAN', flush=True); "
                   "time.sleep(600)"]


def test_a_job_its_agent_stopped_on_shutdown_waits_for_the_machine_and_is_not_counted_a_failure(stack):
    """The agent heartbeats on through its jobs' grace as it shuts down, but its worker no longer
    polls: a job placed there meanwhile would not be picked up, and go back, until it failed."""
    import threading

    s = stack(machines=1, gpus=2, policy={"min_runtime": 0, "grace_period": 10})
    s.submit("stubborn", 1, IGNORES_SIGTERM)
    s.submit("quick", 1, sleeper(8))
    # Both processes started: "running" is shown once the attempt is sent to its agent, and one
    # the agent had not picked up when it stopped polling would end not_started instead.
    s.until(lambda: all("RAN" in s.log(job) for job in ("stubborn", "quick")), timeout=30)
    agent = machine_component("c1/b0/r0/m0")
    stopping = threading.Thread(target=devstack.stop_component, args=(s.data_dir, agent))
    stopping.start()
    s.until(lambda: s.status("quick").state == "queued", timeout=45)  # the grace, and a loaded machine
    stopping.join(timeout=60)  # "stubborn" kept the agent up for its grace
    assert [a.end_reason for a in s.status("quick").attempts] == ["machine_failure"]
    assert s.status("quick").state == "queued"
    devstack.start_component(s.data_dir, agent)
    view = s.wait("quick", timeout=60)
    assert view.state == "succeeded", view.reason
    assert [a.end_reason for a in view.attempts] == ["machine_failure", "completed"]
    s.run(s.client.cancel("stubborn"))


# Saves two checkpoints, then fails (exit 3) once the file named first exists (the test has
# spoiled the newest); resumed, it says what it got back and succeeds. Given a second file name,
# its first resume asks for a key beside its checkpoint, as a machine that asks another store
# (its agent's S3 settings unlike the control plane's) finds none of the job's checkpoints.
SAVES_TWO_THEN_FAILS = [sys.executable, "-c", textwrap.dedent("""
    import os, sys, time
    if len(sys.argv) > 2 and os.environ.get("GPUSCHED_RESUME_SEQ") and not os.path.exists(sys.argv[2]):
        open(sys.argv[2], "w").close()
        os.environ["GPUSCHED_RESUME_FROM"] += "-in-another-store"
    from jobkit import Checkpointer
    ck = Checkpointer.from_env()
    state = ck.restore()
    if state is not None:
        print("RESTORED", state.decode(), flush=True)
        sys.exit(0)
    for state in (b"one", b"two"):
        print("SAVED", ck.save(state).committed, flush=True)
    while not os.path.exists(sys.argv[1]):
        time.sleep(0.1)
    sys.exit(3)
""")]


def test_a_machine_that_cannot_find_a_checkpoint_the_store_holds_sends_the_job_elsewhere_from_it(stack):
    """Believed, it would have thrown the checkpoint away and the job's work with it."""
    s = stack(machines=2, gpus=2, policy={"min_runtime": 0})
    fail_at_once = s.data_dir / "fail-at-once"
    fail_at_once.touch()
    s.submit("misread", 2, SAVES_TWO_THEN_FAILS + [str(fail_at_once), str(s.data_dir / "looked-elsewhere")],
             max_retries=1)
    view = s.wait("misread", timeout=90)
    assert view.state == "succeeded", view.reason
    assert [(a.end_reason, a.resumed_from) for a in view.attempts] == [
        ("failed", None), ("machine_failure", 2), ("completed", 2)]
    assert machine_of(view.attempts[2].gpus[0]) != machine_of(view.attempts[1].gpus[0])
    assert "RESTORED two" in s.log("misread", attempt=3)
    assert all(c.complete for c in view.checkpoints if c.seq == 2)


def test_a_job_whose_newest_checkpoint_is_corrupted_resumes_from_the_one_before(stack):
    """Bit rot, or an object overwritten behind the store's back: the resume checks the bytes,
    and the checkpoint is taken for incomplete instead of failing every attempt sent to it."""
    from activities.checkpoints import s3_client

    s = stack(machines=1, gpus=2, policy={"min_runtime": 0})
    flag = s.data_dir / "spoiled-checkpoint-written"
    s.submit("spoiled", 1, SAVES_TWO_THEN_FAILS + [str(flag)], max_retries=1)
    s.until(lambda: sum(c.complete for c in s.status("spoiled").checkpoints) == 2, timeout=30)
    newest = max(s.status("spoiled").checkpoints, key=lambda c: c.seq)
    settings = s.up.settings
    s3 = s3_client(settings.s3_endpoint, settings.s3_access_key, settings.s3_secret_key, settings.s3_region)
    s3.put_object(Bucket=settings.s3_bucket, Key=newest.key, Body=b"rotten", Metadata={"sha256": "0" * 64})
    flag.touch()
    view = s.wait("spoiled", timeout=90)
    assert view.state == "succeeded", view.reason
    assert [(a.end_reason, a.resumed_from) for a in view.attempts] == [
        ("failed", None), ("machine_failure", newest.seq), ("completed", newest.seq - 1)]
    assert "RESTORED one" in s.log("spoiled", attempt=3)
    [spoiled] = [c for c in view.checkpoints if c.seq == newest.seq]
    assert not spoiled.complete and "corrupted" in spoiled.reason


# Says when SIGTERM came, and leaves a moment later; runs long otherwise.
STOPPED_BY_TERM = [sys.executable, "-c", textwrap.dedent("""
    import signal, sys, time
    def term(*_):
        print("TERM", time.time(), flush=True)
        time.sleep(0.5)
        sys.exit(0)
    signal.signal(signal.SIGTERM, term)
    print("RAN", flush=True)
    time.sleep(300)
""")]


def test_a_job_cancelled_as_its_watch_is_lost_is_stopped_before_its_gpus_are_given_back(stack):
    """The watch's heartbeat timeout and the cancel came in one workflow task (the control worker
    down meanwhile): the cancel is seen first, the gone watch was cancelled, and the allocation
    ended with the process running on (its agent keeps it a minute for a new watch): its GPU was
    free in the store while still in use, and a job placed there had it killed without its grace
    (bench/chaos.py, seed 29)."""
    s = stack(machines=1, gpus=2, policy={"min_runtime": 0, "grace_period": 5})
    s.submit("quiet", 1, STOPPED_BY_TERM)
    s.until(lambda: "RAN" in s.log("quiet"), timeout=30)
    devstack.stop_component(s.data_dir, "control", signal.SIGKILL)
    agent = devstack.load_state(s.data_dir).components[machine_component("c1/b0/r0/m0")]
    os.kill(agent.pid, signal.SIGSTOP)  # the agent alone: its job runs on, unheard by Temporal
    try:
        time.sleep(HEARTBEAT_TIMEOUT + 3)  # the server gives up on the watch
        s.run(s.client.cancel("quiet", "not needed any more"))  # taken by Temporal, no worker to see it
    finally:
        os.kill(agent.pid, signal.SIGCONT)
    devstack.start_component(s.data_dir, "control")  # one workflow task with both
    view = s.wait("quiet", timeout=60)
    assert view.state == "cancelled", view.reason
    stopped = re.search(r"^TERM (\d+\.\d+)", s.log("quiet"), re.M)
    assert stopped, "the allocation ended before its process was told to stop"
    ended_at = s.sql("SELECT ended_at FROM allocations WHERE job_id = 'quiet'")[0]["ended_at"]
    assert ended_at >= float(stopped.group(1)), "the GPUs were given back while the process still ran"
