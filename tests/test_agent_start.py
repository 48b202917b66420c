"""An agent's start, before it serves: what it does when the machine's GPUs cannot be used."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from datetime import timedelta

import pytest

from activities.node import pid_dir
from activities.run_processes import start_ticks
from workers import agent
from workers.settings import agent_log_dir

MACHINE = "c1/b0/r0/m0"


def left_running(tmp_path, allocation_id: int) -> subprocess.Popen:
    """A job an earlier agent of the machine started and was killed away from: its own session,
    and its pid file where the agent keeps them."""
    job = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    pids = pid_dir(agent_log_dir(tmp_path, MACHINE), MACHINE)
    pids.mkdir(parents=True, exist_ok=True)
    (pids / f"{allocation_id}.json").write_text(json.dumps({
        "pid": job.pid, "allocation_id": allocation_id, "job_id": f"old-{allocation_id}",
        "start_ticks": start_ticks(job.pid), "gpus": [0], "report_dir": str(tmp_path / f"reports-{allocation_id}")}))
    return job


def test_an_agent_whose_gpus_cannot_be_read_stops_the_jobs_an_earlier_agent_left_before_it_exits(
        tmp_path, monkeypatch):
    """A driver upgraded under running jobs: NVML fails for the new agent, the old jobs run on,
    and the scheduler, hearing no agent, starts them elsewhere. Before, the agent exited 2 and
    left them running."""
    def no_gpus(*args, **kwargs):
        raise RuntimeError("NVML: Driver/library version mismatch")

    monkeypatch.setattr(agent, "detect_devices", no_gpus)
    jobs = [left_running(tmp_path, alloc) for alloc in (7, 8)]
    try:
        started = time.monotonic()
        assert agent.main(["--machine-id", MACHINE, "--data-dir", str(tmp_path), "--orphan-grace", "2"]) == 2
        assert time.monotonic() - started < 10
        for job in jobs:
            assert job.wait(timeout=5) == -15  # SIGTERM: stopped with its grace, not killed outright
        for alloc in (7, 8):  # and told that grace, not the launch's
            assert json.loads((tmp_path / f"reports-{alloc}" / "stop.json").read_text())["grace_period"] == 2
        # Their pid files stay: the next agent that starts forwards what they saved.
        assert sorted(p.name for p in pid_dir(agent_log_dir(tmp_path, MACHINE), MACHINE).iterdir()) == [
            "7.json", "8.json"]
    finally:
        for job in jobs:
            if job.poll() is None:
                job.kill()
                job.wait()


@pytest.mark.parametrize("what", ["no pid folder at all", "an empty pid folder"])
def test_an_agent_whose_gpus_cannot_be_read_and_that_finds_no_left_jobs_exits_2(tmp_path, monkeypatch, what):
    monkeypatch.setattr(agent, "detect_devices", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("no GPUs")))
    if what == "an empty pid folder":
        pid_dir(agent_log_dir(tmp_path, MACHINE), MACHINE).mkdir(parents=True)
    assert agent.main(["--machine-id", MACHINE, "--data-dir", str(tmp_path)]) == 2


class FakeWorker:
    """Temporal's Worker as the agent uses it; records how it was made. `fails`: its run raises."""

    made: dict = {}
    fails = False

    def __init__(self, client, **kwargs):
        FakeWorker.made = kwargs
        self.is_running = False

    async def run(self):
        if FakeWorker.fails:
            raise RuntimeError("the worker failed")

    async def shutdown(self):
        pass


@pytest.mark.parametrize("fails, code", [(False, 0), (True, 1)],
                         ids=["an agent whose worker ends cleanly exits 0",
                              "an agent whose worker fails exits 1, for its supervisor to start it again"])
def test_an_agent_gives_its_jobs_their_grace_on_shutdown_and_exits_with_what_its_worker_did(
        tmp_path, monkeypatch, fails, code):
    import temporalio.worker

    async def connected(*args, **kwargs):
        return object()

    async def registered(self, stop):
        return True

    async def no_heartbeats(self):
        pass

    monkeypatch.setattr(temporalio.worker, "Worker", FakeWorker)
    monkeypatch.setattr(FakeWorker, "fails", fails)
    monkeypatch.setattr(agent, "connect", connected)
    monkeypatch.setattr(agent.Agent, "register", registered)
    monkeypatch.setattr(agent.Agent, "heartbeat_forever", no_heartbeats)
    assert agent.main(["--machine-id", MACHINE, "--data-dir", str(tmp_path), "--fake-devices", "--gpus", "1",
                       "--grace-period", "30", "--keep-logs-days", "0"]) == code
    # The worker's shutdown waits out the longest grace a job gets (then the jobs are killed).
    assert FakeWorker.made["graceful_shutdown_timeout"] > timedelta(seconds=30)
