"""The node activity: a job runs pinned to its GPUs, is watched, and is stopped with grace.

Jobs are small Python programs (``sys.executable -c``); the activity runs in Temporal's
``ActivityEnvironment``, which needs no server.
"""

from __future__ import annotations

import asyncio
import errno
import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from temporalio.activity import ActivityCancellationDetails
from temporalio.exceptions import ApplicationError, ApplicationErrorCategory
from temporalio.testing import ActivityEnvironment

from activities.node import AGENT_FAULT, SERVER_GAVE_UP, NodeActivities, job_env
from jobkit import STOP_ORDER
from live.fakes import HangingDevices
from workflows.types import ATTEMPT_NOT_HERE, AttachOrder, GpuGrant, RunJobInput, StopOrder

MACHINE = "c1/b0/r0/m0"


def job(code: str, allocation_id: int = 1, **fields) -> RunJobInput:
    fields.setdefault("gpus", [GpuGrant(index=i, path=f"{MACHINE}/{i}") for i in (3, 1)])
    fields.setdefault("command", [sys.executable, "-c", textwrap.dedent(code)])
    return RunJobInput(job_id=fields.pop("job_id", "train-1"), allocation_id=allocation_id,
                       attempt=fields.pop("attempt", 1), **fields)


def node_in(tmp_path: Path, heartbeat_every: float = 0.1, reattach_wait: float = 0.3) -> NodeActivities:
    return NodeActivities(MACHINE, tmp_path / "jobs", heartbeat_every=heartbeat_every, reattach_wait=reattach_wait)


def run(coro):
    return asyncio.run(coro)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it is dead for our purpose.
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] == "Z")


PRINT_ENV = """
    import json, os
    print(json.dumps({k: v for k, v in os.environ.items()
                      if k.startswith(("GPUSCHED_", "CUDA_", "MY_"))}))
"""


# -- the environment ----------------------------------------------------------------------------


def test_the_job_sees_its_gpus_and_its_identity(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUSCHED_PG_DSN", "postgresql://secret@db/gpusched")
    req = job(PRINT_ENV, allocation_id=42, attempt=3, env={"MY_FLAG": "1"}, grace_period=30,
              checkpoint_uri="s3://ckpt/train-1", resume_from="s3://ckpt/train-1/00007")
    before = time.time()
    result = run(ActivityEnvironment().run(node_in(tmp_path).run_job, req))

    assert result.exit_code == 0
    env = json.loads(result.last_log_lines[-1])
    assert before <= float(env.pop("GPUSCHED_LAUNCHED_AT")) <= time.time()
    assert len(env.pop("GPUSCHED_RUN_TOKEN")) == 24
    log_path = str(tmp_path / "jobs" / "train-1" / "attempt-3.log")
    assert env == {
        "CUDA_VISIBLE_DEVICES": "3,1",
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "GPUSCHED_JOB_ID": "train-1",
        "GPUSCHED_ALLOCATION_ID": "42",
        "GPUSCHED_ATTEMPT": "3",
        "GPUSCHED_MACHINE_ID": MACHINE,
        "GPUSCHED_GPUS": f"{MACHINE}/3 {MACHINE}/1",
        "GPUSCHED_NUM_GPUS": "2",
        "GPUSCHED_CHECKPOINT_URI": "s3://ckpt/train-1",
        "GPUSCHED_RESUME_FROM": "s3://ckpt/train-1/00007",
        "GPUSCHED_GRACE_PERIOD": "30",
        "GPUSCHED_LOG": log_path,
        "GPUSCHED_REPORT_DIR": str(tmp_path / "jobs" / "train-1" / "reports-3"),
        "MY_FLAG": "1",
    }
    assert result.log_path == log_path
    header = Path(log_path).read_text().splitlines()[0]
    assert "allocation=42" in header and "CUDA_VISIBLE_DEVICES=3,1" in header


@pytest.mark.parametrize("name, fields, expected", [
    ("a fresh start has no resume variable",
     {}, {"GPUSCHED_RESUME_FROM": None, "GPUSCHED_CHECKPOINT_URI": None}),
    ("the job's own env cannot override the pinning",
     {"env": {"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7", "GPUSCHED_RESUME_FROM": "x"}},
     {"CUDA_VISIBLE_DEVICES": "3,1", "GPUSCHED_RESUME_FROM": None}),
    ("a resumed attempt is told the checkpoint and the digest committed for it",
     {"resume_from": "s3://b/checkpoints/j/0000000003", "resume_seq": 3, "resume_sha256": "ab" * 32},
     {"GPUSCHED_RESUME_FROM": "s3://b/checkpoints/j/0000000003", "GPUSCHED_RESUME_SEQ": "3",
      "GPUSCHED_RESUME_SHA256": "ab" * 32}),
    ("no GPUs hides every GPU",
     {"gpus": []}, {"CUDA_VISIBLE_DEVICES": "", "GPUSCHED_GPUS": "", "GPUSCHED_NUM_GPUS": "0"}),
    ("the agent's settings do not leak, the rest of its environment does",
     {}, {"GPUSCHED_S3_SECRET_KEY": None, "PATH": "/usr/bin"}),
    ("jobkit's own settings in the job's env reach it",
     {"env": {"GPUSCHED_S3_RETRY_S": "900", "GPUSCHED_S3_PART_MB": "128"}},
     {"GPUSCHED_S3_RETRY_S": "900", "GPUSCHED_S3_PART_MB": "128"}),
])
def test_job_env(name, fields, expected):
    env = job_env(job("pass", **fields), MACHINE, Path("/l/a.log"),
                  base={"GPUSCHED_S3_SECRET_KEY": "k", "PATH": "/usr/bin"})
    assert {k: env.get(k) for k in expected} == expected


RESTORE = """
    import time
    from jobkit import Checkpointer
    assert Checkpointer.from_env().restore() == b"state"
    time.sleep(0.6)  # the agent looks into its report directory while it runs, and after
"""


@pytest.mark.parametrize("marker_written", [True, False],
                         ids=["its marker written", "its marker not written (a full disk), without turning the "
                              "job's success into a failure"])
def test_a_resumed_jobs_restart_time_is_forwarded_once(tmp_path, monkeypatch, marker_written):
    from jobkit import Checkpointer

    if not marker_written:
        real_touch = Path.touch

        def touch(path, *args, **kwargs):
            if path.name.endswith(".sent"):
                raise OSError(28, "No space left on device", str(path))
            return real_touch(path, *args, **kwargs)

        monkeypatch.setattr(Path, "touch", touch)

    saved = Checkpointer(f"file://{tmp_path}/ck/").save(b"state")
    sent: list[tuple[str, int, dict]] = []

    async def sink(job_id: str, allocation_id: int, report: dict) -> dict:
        sent.append((job_id, allocation_id, report))
        return {"recorded": True}

    async def no_checkpoints(job_id: str, allocation_id: int, report: dict) -> dict:
        raise AssertionError("the job reported no checkpoint")

    node = NodeActivities(MACHINE, tmp_path / "jobs", heartbeat_every=0.1, report_sink=no_checkpoints,
                          restart_sink=sink)
    req = job(RESTORE, allocation_id=7, attempt=2,
              checkpoint_uri=f"file://{tmp_path}/ck/", resume_from=saved.uri,
              env={"PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    result = run(ActivityEnvironment().run(node.run_job, req))
    assert result.exit_code == 0, result.last_log_lines
    [(job_id, alloc, report)] = sent  # looked for every 0.2 s while it ran, and after: sent once
    assert (job_id, alloc, report["seq"], report["size"]) == ("train-1", 7, 1, 5)
    assert 0 <= report["seconds"] < 30


RESTORE_OR_FAIL = """
    from jobkit import Checkpointer
    Checkpointer.from_env().restore()
"""


@pytest.mark.parametrize("spoiled, stray, unusable", [
    (True, False, "is corrupted"),
    (False, True, None),
    (False, False, None),
], ids=["a job that finds its resume checkpoint corrupted says why in its result",
        "a report of another checkpoint than the one it resumes from is no word on that one",
        "a job that resumes says nothing"])
def test_a_resume_checkpoint_the_job_found_unusable_is_named_in_its_result(tmp_path, spoiled, stray, unusable):
    from jobkit import Checkpointer

    writer = Checkpointer(f"file://{tmp_path}/ck/")
    writer.save(b"older")
    saved = writer.save(b"state")  # number 2: the one to resume from
    if spoiled:
        (tmp_path / "ck" / "0000000002").chmod(0o644)
        (tmp_path / "ck" / "0000000002").write_bytes(b"rotten")
    if stray:  # written by hand: of checkpoint 1, which this attempt was not given
        report_dir = tmp_path / "jobs" / "train-1" / "reports-2"
        report_dir.mkdir(parents=True)
        (report_dir / "unusable.json").write_text('{"seq": 1, "reason": "is corrupted"}')
    req = job(RESTORE_OR_FAIL, attempt=2, checkpoint_uri=f"file://{tmp_path}/ck/", resume_from=saved.uri,
              resume_seq=2, env={"PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    result = run(ActivityEnvironment().run(node_in(tmp_path).run_job, req))
    assert (result.exit_code != 0) is spoiled, result.last_log_lines
    assert (unusable in result.resume_unusable) if unusable else result.resume_unusable is None


# -- how it ends --------------------------------------------------------------------------------


@pytest.mark.parametrize("name, code, exit_code, last_line", [
    ("a job that succeeds exits 0", "print('step 1'); print('done')", 0, "done"),
    ("a job that fails keeps its exit code and last words",
     "import sys\nfor i in range(30): print(f'line {i}')\nsys.exit(3)", 3, "line 29"),
    ("a job that writes binary keeps its last words without NUL, which Postgres cannot store",
     "import sys\nsys.stdout.buffer.write(b'bin\\0ary\\xff\\n'); sys.exit(1)", 1, "bin\ufffdary\ufffd"),
])
def test_a_finished_job_reports_its_exit_and_last_lines(tmp_path, name, code, exit_code, last_line):
    result = run(ActivityEnvironment().run(node_in(tmp_path).run_job, job(code)))
    assert (result.exit_code, result.signal, result.stopped) == (exit_code, None, False)
    assert result.last_log_lines[-1] == last_line
    assert len(result.last_log_lines) <= 20
    assert not any(line.startswith("# gpusched") for line in result.last_log_lines)


@pytest.mark.parametrize("name, code, reading, asked, gpu_faults", [
    ("a job that dies as one of its GPUs fails names the fault", "import sys; sys.exit(1)",
     ["GPU 1: xid:79"], [[3, 1]], ["GPU 1: xid:79"]),
    ("a job that dies on healthy GPUs died of itself", "import sys; sys.exit(1)", [], [[3, 1]], []),
    ("a job killed by a signal not ours is asked about too", "import os; os.kill(os.getpid(), 9)",
     ["GPU 3: lost"], [[3, 1]], ["GPU 3: lost"]),
    ("a job that succeeds is not asked about its GPUs", "print('done')", ["GPU 1: xid:79"], [], []),
])
def test_a_failed_job_names_the_faults_its_gpus_show_as_it_dies(tmp_path, name, code, reading, asked,
                                                                 gpu_faults):
    questions = []

    async def failing_gpus(indices):
        questions.append(indices)
        return reading

    node = NodeActivities(MACHINE, tmp_path / "jobs", heartbeat_every=0.1, gpu_faults=failing_gpus)
    result = run(ActivityEnvironment().run(node.run_job, job(code)))
    assert (questions, result.gpu_faults) == (asked, gpu_faults), name


def test_a_stopped_job_is_not_asked_about_its_gpus(tmp_path):
    async def failing_gpus(indices):
        raise AssertionError("asked")

    node = NodeActivities(MACHINE, tmp_path / "jobs", heartbeat_every=0.1, gpu_faults=failing_gpus)

    async def scenario():
        return await cancel_after_start(node, job(IGNORES_TERM, allocation_id=6, grace_period=0.2))

    raised, _ = run(scenario())
    assert isinstance(raised, asyncio.CancelledError)
    assert node.finished[6].stopped and node.finished[6].gpu_faults == []


@pytest.mark.parametrize("name, command, exit_code", [
    ("a command that does not exist fails with 127", ["/no/such/trainer", "--lr", "1"], 127),
    ("a file that cannot be executed fails with 126", ["{tmp}"], 126),
    ("an empty command fails with 127", [], 127),
])
def test_a_job_that_cannot_start_fails_with_a_reason(tmp_path, name, command, exit_code):
    req = job("", command=[c.format(tmp=tmp_path) for c in command])
    result = run(ActivityEnvironment().run(node_in(tmp_path).run_job, req))
    assert result.exit_code == exit_code
    assert "cannot start" in result.last_log_lines[0]


def test_a_job_runs_in_its_working_directory_and_its_relative_paths_resolve_there(tmp_path):
    project = tmp_path / "project"
    project.mkdir()
    (project / "train.py").write_text("import os; print('ran in', os.getcwd())\n")
    req = job("", command=[sys.executable, "train.py"], working_dir=str(project))
    result = run(ActivityEnvironment().run(node_in(tmp_path).run_job, req))
    assert result.exit_code == 0 and result.last_log_lines[-1] == f"ran in {project}"


def test_a_job_whose_working_directory_is_not_on_its_machine_fails_saying_so(tmp_path):
    req = job("print('never')", working_dir=str(tmp_path / "not-here"))
    result = run(ActivityEnvironment().run(node_in(tmp_path).run_job, req))
    assert result.exit_code == 127
    assert f"working directory cannot be used on machine {MACHINE} (No such file or directory)" in result.last_log_lines[0]
    assert str(tmp_path / "not-here") in result.last_log_lines[0] and "--workdir none" in result.last_log_lines[0]


@pytest.mark.parametrize("code", [errno.ESTALE, errno.EIO, errno.ENOTCONN],
                         ids=["a stale NFS handle", "an I/O error", "a dead FUSE mount"])
def test_a_working_directory_on_a_broken_mount_is_the_machines_fault_not_the_jobs(tmp_path, monkeypatch, code):
    """Taken for a missing directory before, the job failed for good as if its user had erred."""
    where, real_stat = str(tmp_path / "nfs-home"), os.stat

    def failing(path, *args, **kwargs):
        if os.fspath(path) == where:
            raise OSError(code, os.strerror(code), where)
        return real_stat(path, *args, **kwargs)

    monkeypatch.setattr(os, "stat", failing)
    with pytest.raises(ApplicationError) as raised:
        run(ActivityEnvironment().run(node_in(tmp_path).run_job, job("print('never')", working_dir=where)))
    assert raised.value.type == "AgentFault" and "cannot start the job" in str(raised.value)


def test_a_working_directory_that_hangs_does_not_stall_the_agent_and_is_the_machines_fault(tmp_path, monkeypatch):
    import activities.node as node_module

    where, real_stat = str(tmp_path / "hung"), os.stat
    monkeypatch.setattr(node_module, "WORKING_DIR_WAIT", 0.5)
    monkeypatch.setattr(os, "stat", lambda path, *a, **k: time.sleep(2) if os.fspath(path) == where
                        else real_stat(path, *a, **k))
    ticks = []

    async def scenario():
        async def ticker():
            while True:
                ticks.append(time.monotonic())
                await asyncio.sleep(0.05)

        beat = asyncio.create_task(ticker())
        try:
            await ActivityEnvironment().run(node_in(tmp_path).run_job, job("print('never')", working_dir=where))
        finally:
            beat.cancel()

    with pytest.raises(ApplicationError) as raised:
        run(scenario())
    assert raised.value.type == "AgentFault" and "did not answer within 0.5 s" in str(raised.value)
    assert max(b - a for a, b in zip(ticks, ticks[1:])) < 0.4  # the loop went on meanwhile


def test_a_machine_that_cannot_prepare_the_start_fails_the_attempt_not_the_job(tmp_path):
    (tmp_path / "jobs").write_text("a file where the agent's log directory should be")
    with pytest.raises(ApplicationError) as raised:
        run(ActivityEnvironment().run(node_in(tmp_path).run_job, job("print('never')")))
    assert raised.value.type == "AgentFault" and "cannot start the job" in str(raised.value)


def test_the_last_reports_are_forwarded_again_while_the_control_plane_is_unreachable(tmp_path, caplog):
    calls = []

    async def flaky(job_id: str, allocation_id: int, report: dict) -> dict:
        calls.append(report["seq"])
        if len(calls) < 3:
            raise ConnectionError("control plane unreachable")
        return {"committed": True, "reason": "committed"}

    node = NodeActivities(MACHINE, tmp_path / "jobs", heartbeat_every=0.1, report_sink=flaky,
                          final_forward_for=10.0)
    code = """
        import json, os, pathlib
        pathlib.Path(os.environ["GPUSCHED_REPORT_DIR"], "checkpoint-0000000001.json").write_text(json.dumps({"seq": 1}))
    """
    with caplog.at_level("INFO", logger="gpusched.node"):
        result = run(ActivityEnvironment().run(node.run_job, job(code)))
    assert result.exit_code == 0 and calls == [1, 1, 1]
    said = [r for r in caplog.records if "cannot forward" in r.getMessage() and r.levelname == "WARNING"]
    assert len(said) == 1, "an unreachable control plane is said once per report, not at every try"
    [ack] = (tmp_path / "jobs").glob("*/reports-1/checkpoint-0000000001.ack.json")
    assert json.loads(ack.read_text())["committed"]


def test_the_last_reports_to_a_control_plane_that_never_answers_are_given_up_on_in_time(tmp_path):
    """Each report waited the sink's own timeout (30 s for the agent's HTTP client) in turn: eight
    checkpoints taken while the API hung held the attempt's end, and its GPUs, four minutes."""
    async def hangs(job_id: str, allocation_id: int, report: dict) -> dict:
        await asyncio.sleep(1.0)  # the client's timeout, shortened
        raise TimeoutError("no answer")

    node = NodeActivities(MACHINE, tmp_path / "jobs", heartbeat_every=0.1, report_sink=hangs,
                          final_forward_for=1.5)
    code = """
        import json, os, pathlib
        for seq in range(1, 9):
            pathlib.Path(os.environ["GPUSCHED_REPORT_DIR"], f"checkpoint-{seq:010d}.json").write_text(json.dumps({"seq": seq}))
    """
    began = time.monotonic()
    result = run(ActivityEnvironment().run(node.run_job, job(code)))
    assert result.exit_code == 0 and time.monotonic() - began < 4


@pytest.mark.parametrize("content", ["{not json", "[]", "5", "null"],
                         ids=["not JSON", "a JSON list", "a JSON number", "JSON null"])
def test_an_unreadable_report_is_answered_as_refused_and_not_waited_for(tmp_path, content):
    async def sink(job_id: str, allocation_id: int, report: dict) -> dict:
        raise AssertionError("an unreadable report is never sent")

    node = NodeActivities(MACHINE, tmp_path / "jobs", heartbeat_every=0.1, report_sink=sink, final_forward_for=30.0)
    code = f"""
        import os, pathlib
        pathlib.Path(os.environ["GPUSCHED_REPORT_DIR"], "checkpoint-0000000001.json").write_text({content!r})
    """
    began = time.monotonic()
    result = run(ActivityEnvironment().run(node.run_job, job(code)))
    assert result.exit_code == 0 and time.monotonic() - began < 10
    [ack] = (tmp_path / "jobs").glob("*/reports-1/checkpoint-0000000001.ack.json")
    answer = json.loads(ack.read_text())
    assert not answer["committed"] and "cannot read" in answer["reason"]


def test_a_bad_report_does_not_stop_the_next_one_being_forwarded_while_the_job_runs(tmp_path):
    async def sink(job_id: str, allocation_id: int, report: dict) -> dict:
        return {"committed": True, "reason": "committed"}

    node = NodeActivities(MACHINE, tmp_path / "jobs", heartbeat_every=0.1, report_sink=sink, final_forward_for=0.0)
    code = """
        import os, pathlib, time
        reports = pathlib.Path(os.environ["GPUSCHED_REPORT_DIR"])
        (reports / "checkpoint-0000000001.json").write_text("[]")
        time.sleep(0.5)
        (reports / "checkpoint-0000000002.json").write_text('{"seq": 2}')
        ack = reports / "checkpoint-0000000002.ack.json"
        deadline = time.time() + 5
        while not ack.exists() and time.time() < deadline:
            time.sleep(0.05)
        print("answered while running" if ack.exists() else "no answer", flush=True)
    """
    result = run(ActivityEnvironment().run(node.run_job, job(code)))
    assert result.last_log_lines[-1] == "answered while running"


def test_a_job_that_succeeded_on_a_full_disk_is_still_reported_succeeded(tmp_path, monkeypatch):
    """The agent's last line in the log (and a report's answer) cannot be written: the run's
    result stands, instead of failing the activity and so having the job run again."""
    import builtins
    import errno as errnos

    def full(path, mode="r", *args, **kwargs):
        if mode in ("a", "w"):
            raise OSError(errnos.ENOSPC, "No space left on device")
        return builtins.open(path, mode, *args, **kwargs)

    async def sink(job_id: str, allocation_id: int, report: dict) -> dict:
        return {"committed": True, "reason": "committed"}

    node = NodeActivities(MACHINE, tmp_path / "jobs", heartbeat_every=0.1, report_sink=sink, final_forward_for=0.0)
    code = """
        import os, pathlib, time
        pathlib.Path(os.environ["GPUSCHED_REPORT_DIR"], "checkpoint-0000000001.json").write_text('{"seq": 1}')
        time.sleep(0.5)  # the disk fills meanwhile
    """

    async def scenario():
        task = asyncio.create_task(ActivityEnvironment().run(node.run_job, job(code)))
        await asyncio.sleep(0.2)
        monkeypatch.setattr("activities.node.open", full, raising=False)
        monkeypatch.setattr(Path, "write_text", lambda self, *a, **k: full(self, "w"))
        return await task

    result = run(scenario())
    assert (result.exit_code, result.stopped) == (0, False)


def test_old_attempt_logs_are_pruned_but_not_a_running_jobs_nor_recent_ones(tmp_path):
    node = node_in(tmp_path)
    day = 86400
    files = {"old/attempt-1.log": 20 * day, "old/reports-1/checkpoint-0000000001.json": 20 * day,
             "recent/attempt-1.log": 1 * day, "running/attempt-1.log": 20 * day}
    for name, age in files.items():
        path = tmp_path / "jobs" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("x")
        os.utime(path, (time.time() - age, time.time() - age))
    os.utime(tmp_path / "jobs" / "old" / "reports-1", (time.time() - 20 * day,) * 2)
    assert node.prune_logs(14 * day, running={tmp_path / "jobs" / "running"}) == 2
    left = sorted(str(p.relative_to(tmp_path / "jobs")) for p in (tmp_path / "jobs").rglob("*") if p.is_file())
    assert left == ["recent/attempt-1.log", "running/attempt-1.log"]
    assert not (tmp_path / "jobs" / "old").exists()


def test_heartbeats_carry_the_pid_and_allocation(tmp_path):
    beats = []
    env = ActivityEnvironment()
    env.on_heartbeat = lambda *details: beats.append(details[0])
    run(env.run(node_in(tmp_path, heartbeat_every=0.05).run_job,
                job("import time; time.sleep(0.4)", allocation_id=9)))
    assert len(beats) >= 3
    assert all(b["allocation_id"] == 9 and isinstance(b["pid"], int) for b in beats)


@pytest.mark.parametrize("own_session", [False, True],
                         ids=["in the job's process group", "in a session of their own, as torchrun starts its workers"])
def test_processes_left_behind_by_a_finished_job_are_killed(tmp_path, own_session):
    code = f"""
        import subprocess, sys
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"],
                                 start_new_session={own_session})
        print(child.pid, flush=True)
    """
    result = run(ActivityEnvironment().run(node_in(tmp_path).run_job, job(code)))
    assert not alive(int(result.last_log_lines[-1]))  # gone by the time the result says so


# A launcher whose worker leaves its process group (torchrun: start_new_session=True); the worker
# prints its pid, and on SIGTERM says so and exits, or ignores it.
ESCAPING_WORKER = """
    import signal, subprocess, sys, time
    worker = subprocess.Popen([sys.executable, "-c", "import signal, sys, time; "
        "signal.signal(signal.SIGTERM, {on_term}); print('running', flush=True); time.sleep(30)"],
        start_new_session=True)
    print(worker.pid, flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # the launcher leaves at once
    time.sleep(30)
"""


@pytest.mark.parametrize("on_term, grace, killed_by", [
    ("lambda *_: (print('worker saved', flush=True), sys.exit(0))", 5.0, None),
    ("signal.SIG_IGN", 0.5, signal.SIGKILL),
], ids=["a worker out of the job's group gets the SIGTERM and its grace",
        "a worker out of the job's group that ignores SIGTERM is killed after the grace"])
def test_a_stop_reaches_workers_that_left_the_jobs_process_group(tmp_path, on_term, grace, killed_by):
    node = node_in(tmp_path)
    req = job(ESCAPING_WORKER.format(on_term=on_term), allocation_id=16, grace_period=grace)

    async def scenario():
        return await cancel_after_start(node, req)

    _, took = run(scenario())
    worker = int(next(line for line in Path(node._log_path(req)).read_text().splitlines() if line.isdigit()))
    assert not alive(worker), "the worker outlived its run: the next job would share its GPUs"
    if killed_by is None:
        assert "worker saved" in Path(node._log_path(req)).read_text() and took < grace
    else:
        assert took >= grace


# -- stopping -----------------------------------------------------------------------------------

TRAPS_TERM = """
    import signal, sys, time
    def stop(*_):
        print("checkpointing", flush=True)
        sys.exit(0)
    signal.signal(signal.SIGTERM, stop)
    print("running", flush=True)
    time.sleep(30)
"""
IGNORES_TERM = """
    import signal, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print("running", flush=True)
    time.sleep(30)
"""


async def printed(node: NodeActivities, req: RunJobInput, line: str = "running") -> None:
    """Wait until the job of ``req`` has printed ``line``."""
    log = node._log_path(req)
    while not (log.exists() and line in log.read_text().splitlines()):
        await asyncio.sleep(0.02)


async def cancel_after_start(node, req, details=None, cancelled: asyncio.Event | None = None):
    """Run ``req``, cancel it once it printed "running" (and set ``cancelled``); returns (raised,
    seconds to end)."""
    env = ActivityEnvironment()
    task = asyncio.create_task(env.run(node.run_job, req))
    await printed(node, req)
    start = time.monotonic()
    env.cancel(details) if details else env.cancel()
    if cancelled is not None:
        cancelled.set()
    try:
        await task
    except BaseException as err:  # noqa: BLE001 - the test looks at what was raised
        return err, time.monotonic() - start
    return None, time.monotonic() - start


def test_a_cancelled_job_gets_sigterm_and_exits_within_its_grace(tmp_path):
    node = node_in(tmp_path)

    async def scenario():
        return await cancel_after_start(node, job(TRAPS_TERM, allocation_id=5, grace_period=5))

    raised, took = run(scenario())
    assert isinstance(raised, asyncio.CancelledError)
    assert took < 2
    result = node.finished[5]
    assert (result.exit_code, result.stopped) == (0, True)
    assert result.last_log_lines[-1] == "checkpointing"


def test_a_job_that_ignores_sigterm_is_killed_after_its_grace(tmp_path):
    node = node_in(tmp_path)

    async def scenario():
        return await cancel_after_start(node, job(IGNORES_TERM, allocation_id=6, grace_period=0.5))

    raised, took = run(scenario())
    assert isinstance(raised, asyncio.CancelledError)
    assert 0.5 <= took < 2.5
    assert (node.finished[6].signal, node.finished[6].stopped) == (signal.SIGKILL, True)


@pytest.mark.parametrize("launched_with, ordered, order_first, least, most", [
    (30, 0.5, True, 0.5, 2.5),
    (30, 0.5, False, 0.5, 2.5),
    (0.5, 3.0, True, 3.0, 5.0),
    (0.5, 3.0, False, 3.0, 5.0),
], ids=[
    "a shorter ordered grace, ordered before the cancel",
    "a shorter ordered grace, ordered after the cancel",
    "a longer ordered grace, ordered before the cancel",
    "a longer ordered grace, ordered after the cancel (the launch grace had not run out)",
])
def test_a_stop_order_gives_the_job_the_ordered_grace_not_the_one_it_was_launched_with(
        tmp_path, launched_with, ordered, order_first, least, most):
    node = node_in(tmp_path)
    req = job(IGNORES_TERM, allocation_id=15, grace_period=launched_with)

    async def scenario():
        env = ActivityEnvironment()
        task = asyncio.create_task(env.run(node.run_job, req))
        await printed(node, req)
        start = time.monotonic()
        order = StopOrder(allocation_id=15, grace_period=ordered, reason="preempted for j")
        if order_first:
            assert await ActivityEnvironment().run(node.stop_job, order)
        env.cancel()
        if not order_first:
            await asyncio.sleep(0.1)
            assert await ActivityEnvironment().run(node.stop_job, order)
        with pytest.raises(asyncio.CancelledError):
            await task
        return time.monotonic() - start

    took = run(scenario())
    assert least <= took < most, took
    assert (node.finished[15].signal, node.finished[15].stopped) == (signal.SIGKILL, True)
    # The job is told the grace it really has (jobkit follows it once SIGTERM came).
    assert json.loads((node._report_dir(req) / STOP_ORDER).read_text())["grace_period"] == ordered
    assert not run(ActivityEnvironment().run(node.stop_job, StopOrder(allocation_id=15, grace_period=1)))


def test_an_orphan_s_kill_tells_the_job_its_shorter_grace_as_an_order_does(tmp_path):
    """Before, only the scheduler's stop order wrote stop.json: stopped otherwise (an orphan's
    kill, the agent's shutdown), jobkit sized its last save for the launch's grace, and SIGKILL
    came first."""
    node = node_in(tmp_path)
    req = job(IGNORES_TERM, allocation_id=16, grace_period=30)

    async def scenario():
        task = asyncio.create_task(ActivityEnvironment().run(node.run_job, req))
        await printed(node, req)
        await node.kill_allocation(16, 0.5)
        with contextlib.suppress(BaseException):
            await task

    run(scenario())
    assert json.loads((node._report_dir(req) / STOP_ORDER).read_text())["grace_period"] == 0.5


def test_a_stop_gives_the_whole_process_group_its_grace_then_kills_it(tmp_path):
    node = node_in(tmp_path)
    code = """
        import signal, subprocess, sys, time
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # the launcher leaves at once
        child = subprocess.Popen([sys.executable, "-c", "import signal, time; "
            "signal.signal(signal.SIGTERM, signal.SIG_IGN); print('running', flush=True); "
            "time.sleep(30)"])
        print(child.pid, flush=True)
        time.sleep(30)
    """

    async def scenario():
        return await cancel_after_start(node, job(code, allocation_id=14, grace_period=0.5))

    _, took = run(scenario())
    result = node.finished[14]
    assert took >= 0.5  # the worker that ignored SIGTERM held the stop until the grace ran out
    assert (result.exit_code, result.stopped) == (0, True)
    assert not alive(int(result.last_log_lines[0]))


@pytest.mark.parametrize("name, details", [
    ("its heartbeat timed out and nobody watched it again", ActivityCancellationDetails(timed_out=True)),
    ("the server no longer knows it", ActivityCancellationDetails(not_found=True)),
])
def test_an_attempt_the_server_gave_up_on_is_stopped_with_its_grace(tmp_path, name, details):
    node = node_in(tmp_path)
    raised, _ = run(cancel_after_start(node, job(TRAPS_TERM, allocation_id=7), details))
    assert gave_up_benignly(raised)
    assert node.live_allocations() == [] and node.finished[7].stopped
    assert node.finished[7].last_log_lines[-1] == "checkpointing"


def gave_up_benignly(raised: BaseException | None) -> bool:
    """What a watch the server gave up on ends with: benign, so logged without a traceback."""
    return (isinstance(raised, ApplicationError) and raised.type == SERVER_GAVE_UP
            and raised.category == ApplicationErrorCategory.BENIGN)


def attach(node, allocation_id: int):
    return ActivityEnvironment().run(node.attach_job, AttachOrder(allocation_id=allocation_id))


ENDS_SOON = """
    import time
    print("running", flush=True)
    time.sleep(1.0)
    print("done", flush=True)
"""


TIMED_OUT = ActivityCancellationDetails(timed_out=True)
NOT_FOUND = ActivityCancellationDetails(not_found=True)  # also what a server back from an outage says


@pytest.mark.parametrize("name, code, details, workflow_runs, watch_again_after, outcome", [
    ("a watch that timed out, watched again in time: the process runs on to its own end",
     ENDS_SOON, TIMED_OUT, True, 0.1, "exit 0, not stopped"),
    ("a watch the server back from an outage no longer knows, its workflow running: the same",
     ENDS_SOON, NOT_FOUND, True, 0.1, "exit 0, not stopped"),
    ("Temporal cannot say whether the workflow runs: the same",
     ENDS_SOON, NOT_FOUND, None, 0.1, "exit 0, not stopped"),
    ("the process ended while nobody watched: the next watch gets its result",
     "print('running', flush=True)", TIMED_OUT, True, 0.5, "exit 0, not stopped"),
    ("nobody watched again in time: the agent stopped it, and says so to a late watch",
     TRAPS_TERM, TIMED_OUT, True, 1.0, "AttemptAbandoned"),
    ("the workflow has ended (terminated): stopped at once, and a watch cannot take the stop for an end",
     TRAPS_TERM, NOT_FOUND, False, 0.1, "AttemptAbandoned"),
])
def test_a_watch_the_server_gave_up_on_can_be_taken_up_again(tmp_path, name, code, details, workflow_runs,
                                                             watch_again_after, outcome):
    node = node_in(tmp_path, reattach_wait=0.5)
    asked = []

    async def workflow_running(workflow_id: str) -> bool | None:
        asked.append(workflow_id)
        return workflow_runs

    node.workflow_running = workflow_running

    async def scenario():
        cancelled = asyncio.Event()
        first = asyncio.create_task(cancel_after_start(node, job(code, allocation_id=9), details, cancelled))
        await cancelled.wait()  # counted from the server's giving up, not from the launch
        await asyncio.sleep(watch_again_after)
        try:
            result = await attach(node, 9)
            said = f"exit {result.exit_code}, {'stopped' if result.stopped else 'not stopped'}"
        except ApplicationError as e:
            said = e.type
        return said, await first

    said, (raised, _) = run(scenario())
    assert said == outcome
    assert gave_up_benignly(raised) or raised is None
    assert node.live_allocations() == []
    log = Path(node.finished[9].log_path).read_text()
    assert ("done" in log) == (code == ENDS_SOON)
    assert asked in ([], ["test"])  # the watch's own workflow, when the server gave up on it while it ran


def test_a_watch_of_an_attempt_this_agent_never_ran_is_refused(tmp_path):
    # An agent started since (the earlier one's processes were reaped): nothing to watch, and
    # nothing is started in its place.
    node = node_in(tmp_path)
    with pytest.raises(ApplicationError) as refused:
        run(attach(node, 5))
    assert refused.value.type == ATTEMPT_NOT_HERE and refused.value.non_retryable
    assert node.live_allocations() == [] and 5 not in node.finished


@pytest.mark.parametrize("stop", ["cancel", "worker_shutdown"],
                         ids=["a cancel", "the agent's shutdown (it was requeued and run again)"])
def test_a_job_that_ended_on_its_own_as_the_stop_came_keeps_its_result(tmp_path, stop):
    answer = asyncio.Event()

    async def slow(job_id: str, allocation_id: int, report: dict) -> dict:
        await answer.wait()
        return {"committed": True, "reason": "committed"}

    node = NodeActivities(MACHINE, tmp_path / "jobs", heartbeat_every=0.1, report_sink=slow)
    code = """
        import json, os, pathlib
        print("running", flush=True)
        pathlib.Path(os.environ["GPUSCHED_REPORT_DIR"], "checkpoint-0000000001.json").write_text(json.dumps({"seq": 1}))
    """

    async def scenario():
        env = ActivityEnvironment()
        task = asyncio.create_task(env.run(node.run_job, job(code, allocation_id=12)))
        while not (node.processes.get(12) and node.processes[12].process
                   and node.processes[12].process.returncode is not None):
            await asyncio.sleep(0.02)  # exited 0; its last report is being forwarded
        getattr(env, stop)()
        await asyncio.sleep(0.1)
        answer.set()
        return await task

    result = run(scenario())
    assert (result.exit_code, result.stopped) == (0, False)


def test_a_new_attempt_on_gpus_an_earlier_one_still_holds_kills_that_one_first(tmp_path):
    node = node_in(tmp_path)

    async def scenario():
        old = job(IGNORES_TERM, allocation_id=20, grace_period=30.0)
        stale = asyncio.create_task(ActivityEnvironment().run(node.run_job, old))
        await printed(node, old)
        gpu_1 = [GpuGrant(index=1, path=f"{MACHINE}/1")]
        began = time.monotonic()
        fresh = await ActivityEnvironment().run(node.run_job, job("print('mine')", allocation_id=21, gpus=gpu_1))
        return await stale, fresh, time.monotonic() - began

    stale, fresh, took = run(scenario())
    assert stale.stopped and stale.signal == signal.SIGKILL and took < 10  # no 30 s grace: a zombie
    assert fresh.exit_code == 0 and fresh.last_log_lines[-1] == "mine"


def test_worker_shutdown_stops_the_job_and_fails_the_attempt(tmp_path):
    node = node_in(tmp_path)

    async def scenario():
        env = ActivityEnvironment()
        req = job(TRAPS_TERM, allocation_id=8)
        task = asyncio.create_task(env.run(node.run_job, req))
        await printed(node, req)
        env.worker_shutdown()
        with pytest.raises(ApplicationError) as raised:
            await task
        return raised.value

    err = run(scenario())
    assert (err.type, err.non_retryable) == ("AgentShutdown", True)
    assert node.finished[8].stopped


SAVES_AND_EXITS_143 = """
    import sys, time
    print("running", flush=True)
    time.sleep(0.3)
    sys.exit(143)  # jobkit's EXIT_STOPPED, after the checkpoint a SIGTERM not the agent's asked for
"""


@pytest.mark.parametrize("end_code, shutdown_after, shut_down", [
    (SAVES_AND_EXITS_143, 0.02, True),
    ("import os, signal, time; print('running', flush=True); time.sleep(0.3); os.kill(os.getpid(), signal.SIGTERM)",
     0.02, True),
    (SAVES_AND_EXITS_143, None, False),
    ("import sys, time; print('running', flush=True); time.sleep(0.3); sys.exit(0)", 0.02, False),
], ids=["a job that saved and exited 143 as the machine stops is requeued as stopped by the shutdown",
        "one killed by the SIGTERM that stops the agent too",
        "one that exits 143 while the agent runs on keeps its end: the command's own",
        "one that finished as the agent stops keeps its result"])
def test_a_job_ended_by_the_sigterm_that_stops_its_agent_is_stopped_by_the_shutdown(tmp_path, end_code, shutdown_after,
                                                                                    shut_down):
    """systemd's default KillMode SIGTERMs a service's every process at once: a job whose end beat
    the agent's own shutdown was taken for finished (exit 0 after its checkpoint) or failed."""
    node = NodeActivities(MACHINE, tmp_path / "jobs", heartbeat_every=0.1, shutdown_follows=0.5)
    req = job(end_code, allocation_id=31)

    async def scenario():
        env = ActivityEnvironment()
        task = asyncio.create_task(env.run(node.run_job, req))
        await printed(node, req)
        while (running := node.processes.get(31)) is not None and running.process.returncode is None:
            await asyncio.sleep(0.005)
        if shutdown_after is not None:
            await asyncio.sleep(shutdown_after)
            env.worker_shutdown()
        return await asyncio.wait_for(task, 10)

    if shut_down:
        with pytest.raises(ApplicationError) as raised:
            run(scenario())
        assert raised.value.type == "AgentShutdown"
    else:
        result = run(scenario())
        assert not result.stopped and result.exit_code in (0, 143)


CHECKPOINTS_SLOWLY = """
    import signal, sys, time
    def stop(*_):
        print("checkpointing", flush=True)
        time.sleep(1.0)  # writing the checkpoint
        print("saved", flush=True)
        sys.exit(0)
    signal.signal(signal.SIGTERM, stop)
    print("running", flush=True)
    time.sleep(30)
"""


def _stop_by_cancel(env):
    env.cancel()


def _stop_by_a_second_cancel_too(env):
    env.cancel()
    asyncio.get_running_loop().call_later(0.3, env.cancel)


def test_an_agent_shutting_down_stops_a_job_the_server_gave_up_on_with_its_shutdown_grace(tmp_path):
    """Such a job runs on for a watch to come again; the agent shutting down polls no more, so
    none can come. It waited the whole wait, then stopped the job with its launch grace, past
    the time the agent's supervisor gives it to stop."""
    node = NodeActivities(MACHINE, tmp_path / "jobs", heartbeat_every=0.1, reattach_wait=30, shutdown_grace=0.5)
    req = job(IGNORES_TERM, allocation_id=18, grace_period=20)

    async def scenario():
        env = ActivityEnvironment()
        task = asyncio.create_task(env.run(node.run_job, req))
        await printed(node, req)
        env.cancel(ActivityCancellationDetails(not_found=True))
        await asyncio.sleep(0.3)
        start = time.monotonic()
        env.worker_shutdown()
        with contextlib.suppress(BaseException):
            await asyncio.wait_for(task, 10)
        return time.monotonic() - start

    assert run(scenario()) < 3
    assert (node.finished[18].signal, node.finished[18].stopped) == (signal.SIGKILL, True)


def _stop_by_worker_shutdown(env):
    env.worker_shutdown()


@pytest.mark.parametrize("stop", [_stop_by_cancel, _stop_by_a_second_cancel_too, _stop_by_worker_shutdown],
                         ids=["a cancelled job", "a job cancelled twice", "a job stopped by the agent's shutdown"])
def test_a_job_checkpointing_in_its_grace_is_heartbeaten_for_until_it_exits(tmp_path, stop):
    """The server holds an activity it asked to cancel to its heartbeat timeout too: a stop that
    went quiet would end the attempt, and give its GPUs away, while the job still saves."""
    node = node_in(tmp_path, heartbeat_every=0.05)
    beats: list[float] = []

    async def scenario():
        env = ActivityEnvironment()
        env.on_heartbeat = lambda *details: beats.append(time.monotonic())
        req = job(CHECKPOINTS_SLOWLY, allocation_id=15, grace_period=10)
        task = asyncio.create_task(env.run(node.run_job, req))
        await printed(node, req)
        asked = time.monotonic()
        stop(env)
        try:
            await task
        except BaseException:  # noqa: BLE001 - cancelled, or AgentShutdown: both end the attempt
            pass
        return asked, time.monotonic()

    asked, ended = run(scenario())
    result = node.finished[15]
    assert (result.exit_code, result.stopped, result.last_log_lines[-1]) == (0, True, "saved")
    assert ended - asked >= 1.0, "the attempt ended before the job had saved"
    during = [b for b in beats if b > asked]
    gaps = [b - a for a, b in zip([asked] + during, during + [ended])]
    assert len(during) >= 10 and max(gaps) < 0.5, f"silent for {max(gaps):.2f} s of a 1 s stop"


# -- idempotency ------------------------------------------------------------------------------


def test_a_duplicate_run_of_an_allocation_attaches_to_its_process(tmp_path):
    node = node_in(tmp_path)
    code = "import time; print('started', flush=True); time.sleep(0.5); print('done')"

    async def scenario():
        req = job(code, allocation_id=11)
        first = asyncio.create_task(ActivityEnvironment().run(node.run_job, req))
        await asyncio.sleep(0.1)
        second = asyncio.create_task(ActivityEnvironment().run(node.run_job, req))
        results = await asyncio.gather(first, second)
        # A retry after the end gets the same result, without running the job again.
        return results + [await ActivityEnvironment().run(node.run_job, req)]

    a, b, c = run(scenario())
    assert a == b == c
    assert a.exit_code == 0
    assert Path(a.log_path).read_text().splitlines().count("started") == 1


def test_duplicates_arriving_together_start_one_process(tmp_path):
    node = node_in(tmp_path)
    req = job("print('started')", allocation_id=12)

    async def scenario():
        runs = [ActivityEnvironment().run(node.run_job, req) for _ in range(3)]
        return await asyncio.gather(*runs)

    results = run(scenario())
    assert len({r.model_dump_json() for r in results}) == 1
    assert Path(results[0].log_path).read_text().splitlines().count("started") == 1


def test_workers_an_earlier_agents_run_left_outside_its_group_are_reaped_by_its_token(tmp_path):
    node = node_in(tmp_path)
    node.pid_dir.mkdir(parents=True)
    token = "f00d" * 6
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], start_new_session=True,
                              env={**os.environ, "GPUSCHED_RUN_TOKEN": token})
    deadline = time.monotonic() + 5
    # Until it has exec'd, the child shows the test's environment, without the token: a busy
    # machine (CI's) reaped before that once and found nothing.
    while token.encode() not in Path(f"/proc/{worker.pid}/environ").read_bytes() and time.monotonic() < deadline:
        time.sleep(0.01)
    (node.pid_dir / "17.json").write_text(json.dumps(
        {"pid": 999_999_999, "allocation_id": 17, "job_id": "old", "start_ticks": None, "token": token}))
    try:
        assert run(node.reap_leftovers(grace=1)) == [17]  # its leader is long gone; its worker is not
        assert worker.wait(timeout=2) == -signal.SIGTERM
    finally:
        if worker.poll() is None:
            worker.kill()


def test_process_groups_left_by_an_earlier_agent_are_reaped(tmp_path):
    node = node_in(tmp_path)
    node.pid_dir.mkdir(parents=True)
    leftover = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"],
                                start_new_session=True)
    from activities.run_processes import start_ticks

    (node.pid_dir / "13.json").write_text(json.dumps(
        {"pid": leftover.pid, "allocation_id": 13, "job_id": "old",
         "start_ticks": start_ticks(leftover.pid)}))
    try:
        assert run(node.reap_leftovers(grace=1)) == [13]
        assert leftover.wait(timeout=2) == -signal.SIGTERM
        assert not list(node.pid_dir.iterdir())
    finally:
        if leftover.poll() is None:
            leftover.kill()


def test_a_process_left_by_an_earlier_agent_is_told_the_grace_it_really_gets_before_it_is_stopped(tmp_path):
    """Its GPUSCHED_GRACE_PERIOD says the launch's grace; told nothing, jobkit planned a save for
    that and was killed in the middle of it."""
    node = node_in(tmp_path)
    node.pid_dir.mkdir(parents=True)
    reports = tmp_path / "reports-1"
    told = tmp_path / "told"
    leftover = subprocess.Popen([sys.executable, "-c", (
        "import pathlib, signal, sys, time\n"
        "def on_term(*_):\n"
        f"    pathlib.Path({str(told)!r}).write_text(pathlib.Path({str(reports / 'stop.json')!r}).read_text())\n"
        "    sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, on_term)\n"
        "print('ready', flush=True)\n"
        "time.sleep(30)\n")], start_new_session=True, stdout=subprocess.PIPE, text=True)
    assert leftover.stdout.readline() == "ready\n"
    from activities.run_processes import start_ticks

    (node.pid_dir / "13.json").write_text(json.dumps(
        {"pid": leftover.pid, "allocation_id": 13, "job_id": "old", "report_dir": str(reports),
         "start_ticks": start_ticks(leftover.pid)}))
    try:
        assert run(node.reap_leftovers(grace=3)) == [13]
        assert leftover.wait(timeout=2) == 0
        assert json.loads(told.read_text())["grace_period"] == 3
    finally:
        leftover.stdout.close()
        if leftover.poll() is None:
            leftover.kill()


def daemon_group_whose_leader_has_exited(token: str | None = None):
    """A process group whose leader exited and left a member behind, as a daemon's does: the
    group's id is the dead leader's pid. Returns (that id, the member)."""
    env = {**os.environ, **({"GPUSCHED_RUN_TOKEN": token} if token else {})}
    leader = subprocess.Popen([sys.executable, "-c", "import os, subprocess, sys; print(os.getpid(), subprocess.Popen("
                               "[sys.executable, '-c', 'import time; time.sleep(30)'], stdout=subprocess.DEVNULL).pid, "
                               "flush=True)"], start_new_session=True, stdout=subprocess.PIPE, text=True, env=env)
    pgid, member = map(int, leader.stdout.readline().split())
    leader.wait(timeout=5)
    leader.stdout.close()
    deadline = time.monotonic() + 5
    while (token and token.encode() not in Path(f"/proc/{member}/environ").read_bytes()
           and time.monotonic() < deadline):
        time.sleep(0.01)
    return pgid, member


def still_runs(pid: int) -> bool:
    from activities.run_processes import _stat_fields

    fields = _stat_fields(Path(f"/proc/{pid}/stat"))
    return fields is not None and fields[0] != "Z"


@pytest.mark.parametrize("members_token, boot, reaped", [
    (None, "this", False),
    ("f00d" * 6, "this", True),
    ("f00d" * 6, "another", False),
], ids=["a group its number now names, whose members carry no token of the run, is not signalled",
        "a group whose leader is gone but whose members carry the run's token is the run's, and reaped",
        "nothing is signalled for a run of an earlier boot: its numbers are anyone's now"])
def test_an_earlier_agents_pid_file_signals_only_the_runs_own_processes(tmp_path, members_token, boot, reaped):
    from activities.run_processes import boot_id

    node = node_in(tmp_path)
    node.pid_dir.mkdir(parents=True)
    pgid, member = daemon_group_whose_leader_has_exited(members_token if boot == "this" else None)
    (node.pid_dir / "18.json").write_text(json.dumps(
        {"pid": pgid, "allocation_id": 18, "job_id": "old", "start_ticks": 12345, "token": "f00d" * 6,
         "boot_id": boot_id() if boot == "this" else "an-earlier-boot"}))
    try:
        assert run(node.reap_leftovers(grace=1)) == ([18] if reaped else [])
        time.sleep(0.2)
        assert still_runs(member) is not reaped
    finally:
        os.killpg(pgid, signal.SIGKILL) if still_runs(member) else None


def test_a_process_left_by_an_earlier_agent_that_outlives_sigkill_keeps_its_gpus_reported_sick(tmp_path, monkeypatch):
    """An agent gives up on such a process and leaves its pid file for the next one: the next
    one gave up too, then deleted the file and reported the GPUs healthy beside it."""
    import activities.run_processes as rp

    real_signal = rp.RunProcesses.signal
    monkeypatch.setattr(rp, "KILL_WAIT", 0.2)
    monkeypatch.setattr(rp.RunProcesses, "signal",
                        lambda self, sig: None if sig == signal.SIGKILL else real_signal(self, sig))
    node = node_in(tmp_path)
    node.pid_dir.mkdir(parents=True)
    stuck = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, "
                              "signal.SIG_IGN); print('ready', flush=True); time.sleep(30)"],
                             start_new_session=True, stdout=subprocess.PIPE, text=True)
    assert stuck.stdout.readline() == "ready\n"
    (node.pid_dir / "14.json").write_text(json.dumps(
        {"pid": stuck.pid, "allocation_id": 14, "job_id": "old", "start_ticks": rp.start_ticks(stuck.pid),
         "gpus": [2, 5]}))
    try:
        assert run(node.reap_leftovers(grace=0.1)) == [14]
        assert node.lingering_gpus() == {2, 5} and list(node.pid_dir.glob("14.json"))
        stuck.kill()
        stuck.wait(timeout=5)
        assert node.lingering_gpus() == set() and not list(node.pid_dir.glob("14.json"))
    finally:
        if stuck.poll() is None:
            stuck.kill()
        stuck.stdout.close()


def test_the_process_groups_of_an_earlier_agent_are_reaped_together_not_one_after_the_other(tmp_path):
    """Each may wait its grace and a minute for the control plane to take its reports: one
    after the other, a machine of eight jobs did not serve for minutes after its agent restarted
    while the control plane was down (bench/chaos.py saw 80 s for three)."""
    from activities.run_processes import start_ticks

    leftovers = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], start_new_session=True)
                 for _ in range(3)]
    asked = set()
    all_asked = asyncio.Event()

    async def sink(job_id: str, allocation_id: int, report: dict) -> dict:
        asked.add(allocation_id)
        if len(asked) == len(leftovers):
            all_asked.set()
        await asyncio.wait_for(all_asked.wait(), 5)  # answered only once every one has asked
        return {"committed": True, "reason": "its allocation is current"}

    node = NodeActivities(MACHINE, tmp_path / "jobs", heartbeat_every=0.1, report_sink=sink)
    node.pid_dir.mkdir(parents=True)
    for alloc, leftover in enumerate(leftovers, start=30):
        reports = tmp_path / f"reports-{alloc}"
        reports.mkdir()
        (reports / "checkpoint-0000000001.json").write_text(json.dumps({"seq": 1, "key": "k", "size": 1, "sha256": "0"}))
        (node.pid_dir / f"{alloc}.json").write_text(json.dumps(
            {"pid": leftover.pid, "allocation_id": alloc, "job_id": f"old-{alloc}",
             "start_ticks": start_ticks(leftover.pid), "report_dir": str(reports)}))
    try:
        assert sorted(run(node.reap_leftovers(grace=1))) == [30, 31, 32]
        assert all((tmp_path / f"reports-{a}" / "checkpoint-0000000001.ack.json").exists() for a in (30, 31, 32))
        assert [p.wait(timeout=2) for p in leftovers] == [-signal.SIGTERM] * 3
    finally:
        for leftover in leftovers:
            if leftover.poll() is None:
                leftover.kill()


@pytest.mark.parametrize("sink_answers, forwarded_while_running", [(True, True), (False, False)],
                         ids=["what it saved goes to the control plane before it is stopped",
                              "a control plane that does not answer does not hold the stop up"])
def test_an_earlier_agents_process_has_its_reports_forwarded_before_it_is_stopped(tmp_path, sink_answers,
                                                                                  forwarded_while_running):
    """Its allocation may still be the job's current one as the agent comes back, and not once the
    stop (with its grace) is done: a checkpoint it saved meanwhile would be refused as a zombie's."""
    from activities.run_processes import start_ticks

    leftover = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], start_new_session=True)
    seen: list[bool] = []

    async def sink(job_id: str, allocation_id: int, report: dict) -> dict:
        seen.append(leftover.poll() is None)
        if not sink_answers:  # the control plane is not back yet: no answer, then no connection
            if len(seen) == 1:
                await asyncio.sleep(60)
            raise ConnectionError("connection refused")
        return {"committed": True, "reason": "its allocation is current"}

    node = NodeActivities(MACHINE, tmp_path / "jobs", heartbeat_every=0.1, report_sink=sink, final_forward_for=0.0)
    reports = tmp_path / "reports"
    reports.mkdir()
    (reports / "checkpoint-0000000003.json").write_text(json.dumps({"seq": 3, "key": "k", "size": 1, "sha256": "0"}))
    node.pid_dir.mkdir(parents=True)
    (node.pid_dir / "21.json").write_text(json.dumps(
        {"pid": leftover.pid, "allocation_id": 21, "job_id": "old", "start_ticks": start_ticks(leftover.pid),
         "report_dir": str(reports)}))
    try:
        began = time.monotonic()
        assert run(node.reap_leftovers(grace=1)) == [21]
        assert leftover.wait(timeout=2) == -signal.SIGTERM
        assert seen[0] is True  # asked while the process still ran
        assert (reports / "checkpoint-0000000003.ack.json").exists() is forwarded_while_running
        assert time.monotonic() - began < 10  # a silent control plane held the stop up 3 s at most
    finally:
        if leftover.poll() is None:
            leftover.kill()


# -- orphans, as the agent finds them -----------------------------------------------------------


@pytest.mark.parametrize("name, answers, killed", [
    ("an allocation the API still holds is never an orphan", [([5], [5]), ([5], [5])], []),
    ("one answer without it is not enough", [([5], [])], []),
    ("two answers in a row without it make it an orphan", [([5], []), ([5], [])], [5]),
    ("a miss that is not repeated is forgotten", [([5], []), ([5], [5]), ([5], [])], []),
    ("an allocation first sent with a later heartbeat is not an orphan for its first miss",
     [([5], [5]), ([5, 6], [5]), ([5, 6], [5, 6])], []),
    ("and from then, two misses in a row make it an orphan", [([5], [5]), ([5, 6], [5]), ([5, 6], [5])], [6]),
    ("an answer that does not list live allocations condemns nothing",
     [([5], None), ([5], None)], []),
])
def test_orphan_watch(name, answers, killed):
    from workers.agent import OrphanWatch

    watch = OrphanWatch(confirm=2)
    result = []
    for sent, live in answers:
        result = watch.update(sent, live)
    assert result == killed


def test_the_agent_stops_a_job_whose_allocation_the_api_dropped(tmp_path):
    import httpx

    from workers.agent import Agent
    from workers.devices import FakeDevices
    from workers.settings import Settings

    node = node_in(tmp_path)
    live = {"live_allocations": [21]}
    beats = []

    def api(request: httpx.Request) -> httpx.Response:
        beats.append((request.url.path, json.loads(request.content)))
        return httpx.Response(200, json=live)

    async def scenario():
        agent = Agent(MACHINE, Settings(api_url="http://api"), FakeDevices(4), node,
                      interval=0.05, orphan_grace=1.0)
        agent.http = httpx.AsyncClient(transport=httpx.MockTransport(api))
        req = job(TRAPS_TERM, allocation_id=21)
        task = asyncio.create_task(ActivityEnvironment().run(node.run_job, req))
        await printed(node, req)
        await agent.heartbeat()
        assert node.live_allocations() == [21]  # still held
        live["live_allocations"] = []
        await agent.heartbeat()
        await agent.heartbeat()  # second miss: stopped
        result = await task
        await agent.close()
        return result

    result = run(scenario())
    assert (result.exit_code, result.stopped) == (0, True)
    path, body = beats[0]
    assert path == f"/machines/{MACHINE}/heartbeat"
    assert body["running_allocations"] == [21] and len(body["gpus"]) == 4


def test_the_agent_names_the_faults_that_kill_and_tells_the_control_plane_at_once(tmp_path):
    import httpx

    from workers.agent import Agent
    from workers.devices import ECC_UNCORRECTABLE, THERMAL_THROTTLE, FakeDevices, inject_fault
    from workers.settings import Settings

    faults = tmp_path / "faults.json"
    beats = []

    def api(request: httpx.Request) -> httpx.Response:
        beats.append({g["index"]: g["faults"] for g in json.loads(request.content)["gpus"]})
        return httpx.Response(200, json={"live_allocations": []})

    async def scenario():
        node = node_in(tmp_path)
        agent = Agent(MACHINE, Settings(api_url="http://api"), FakeDevices(4, fault_file=faults), node,
                      interval=60, orphan_grace=1.0)
        agent.http = httpx.AsyncClient(transport=httpx.MockTransport(api))
        node.gpu_faults = agent.failing_gpus
        # The job dies as its GPU falls off the bus; the other GPU it holds only runs hot.
        dies = f"""
            from workers.devices import inject_fault
            inject_fault(__import__("pathlib").Path({str(faults)!r}), 3, "xid:79")
            raise SystemExit(1)
        """
        inject_fault(faults, 1, THERMAL_THROTTLE)
        inject_fault(faults, 2, ECC_UNCORRECTABLE)  # not the job's GPU
        sick = await ActivityEnvironment().run(node.run_job, job(dies, allocation_id=7))
        beats_after_sick = len(beats)
        hot = await ActivityEnvironment().run(node.run_job, job("raise SystemExit(1)", allocation_id=8,
                                                                gpus=[GpuGrant(index=1, path=f"{MACHINE}/1")]))
        await agent.close()
        return sick, beats_after_sick, hot

    sick, beats_after_sick, hot = run(scenario())
    assert sick.gpu_faults == ["GPU 3: xid:79"]
    assert beats_after_sick == 1 and beats[0][3] == ["xid:79"]  # sent before the attempt ended
    assert hot.gpu_faults == [] and len(beats) == 1


def test_a_job_that_dies_as_nvml_stops_answering_is_taken_for_dead_of_its_gpus(tmp_path):
    """NVML often hangs as a GPU falls off the bus: the last reading, from before, showed the GPUs
    healthy, and the job was failed as its own fault."""
    import httpx

    from workers.agent import Agent
    from workers.settings import Settings

    devices = HangingDevices(4)

    async def scenario():
        node = node_in(tmp_path)
        agent = Agent(MACHINE, Settings(api_url="http://api"), devices, node, interval=1, orphan_grace=1.0)
        agent.http = httpx.AsyncClient(transport=httpx.MockTransport(lambda r: httpx.Response(
            200, json={"live_allocations": []})))
        node.gpu_faults = agent.failing_gpus
        assert all(h.healthy for h in await agent.health())  # a heartbeat's reading, before
        died = await ActivityEnvironment().run(node.run_job, job("raise SystemExit(1)", allocation_id=9))
        devices.release.set()
        await agent.close()
        return died

    died = run(scenario())
    assert [fault.split(" (")[0] for fault in died.gpu_faults] == ["GPU 1: nvml_error", "GPU 3: nvml_error"]


def test_a_job_that_prints_without_end_has_its_log_cut_back_to_its_end(tmp_path):
    node = NodeActivities(MACHINE, tmp_path / "jobs", heartbeat_every=0.1, max_log_bytes=64 * 1024,
                          log_check_every=0.05)
    chatty = """
        import sys, time
        for i in range(40):
            sys.stdout.write(f"line {i} " + "x" * 200 + "\\n" * 1)
            sys.stdout.write("".join(f"step {i}.{j} {'y' * 100}\\n" for j in range(100)))
            sys.stdout.flush()
            time.sleep(0.02)
        print("the end", flush=True)
    """
    result = run(ActivityEnvironment().run(node.run_job, job(chatty)))
    text = Path(result.log_path).read_text()
    assert result.exit_code == 0 and result.last_log_lines[-1] == "the end"
    assert len(text) < 4 * 64 * 1024  # about 430 KiB printed
    assert "this log passed 65536 bytes" in text and "were dropped" in text
    assert all(line.startswith(("# gpusched", "line ", "step ", "the end")) for line in text.splitlines())


@pytest.mark.parametrize("name, status, body, answer", [
    ("a verdict is the answer", 200, {"committed": True, "reason": "committed"}, {"committed": True, "reason": "committed"}),
    ("a refusal is the answer", 404, {"detail": "no job"}, "refused"),
    ("a wrong token is no verdict: sent again", 401, {"detail": "missing or wrong API token"}, "raises"),
    ("a server error is no verdict: sent again", 503, {"detail": "store down"}, "raises"),
])
def test_a_checkpoint_report_is_sent_again_unless_the_control_plane_judged_it(name, status, body, answer):
    import httpx

    from workers.agent import forward_checkpoint

    async def scenario():
        http = httpx.AsyncClient(transport=httpx.MockTransport(lambda request: httpx.Response(status, json=body)))
        try:
            return await forward_checkpoint(http, "http://api", "train-1", 7, {"seq": 1})
        finally:
            await http.aclose()

    if answer == "raises":
        with pytest.raises(httpx.HTTPStatusError):
            run(scenario())
    elif answer == "refused":
        result = run(scenario())
        assert result["committed"] is False and "HTTP 404" in result["reason"], name
    else:
        assert run(scenario()) == answer, name


# -- processes that outlive SIGKILL ---------------------------------------------------------------


def test_a_run_whose_processes_outlive_sigkill_keeps_its_gpus_reported_sick_until_they_are_gone(tmp_path, monkeypatch):
    """A process stuck in the kernel (a hung file system, the driver) survives SIGKILL for a
    while: the run ends, but its GPUs must not look free to the next job."""
    import activities.run_processes as rp

    stuck = {"alive": True}
    real_alive = rp.RunProcesses.alive
    monkeypatch.setattr(rp, "KILL_WAIT", 0.1)
    monkeypatch.setattr(rp.RunProcesses, "alive", lambda self: stuck["alive"] or real_alive(self))
    node = node_in(tmp_path)
    result = run(ActivityEnvironment().run(node.run_job, job("print('done')", gpus=[GpuGrant(index=1, path="c1/b0/r0/m0/1")])))
    assert result.exit_code == 0
    assert node.lingering_gpus() == {1}
    assert list(node.pid_dir.glob("1.json")), "kept for an agent started after this one to reap"
    stuck["alive"] = False
    assert node.lingering_gpus() == set() and not list(node.pid_dir.glob("1.json"))


def test_a_stopped_job_whose_process_outlives_sigkill_ends_its_run_and_keeps_its_gpus_reported_sick(
        tmp_path, monkeypatch):
    """The job's own process stuck in the kernel: the run waited for its exit for ever, so the
    workflow's stop never completed, a next job on its GPUs never started, and the agent could
    not shut down. (SIGKILL is not delivered here, which is what such a process makes of it.)"""
    import activities.run_processes as rp

    real_signal = rp.RunProcesses.signal
    monkeypatch.setattr(rp, "KILL_WAIT", 0.2)
    monkeypatch.setattr(rp.RunProcesses, "signal",
                        lambda self, sig: None if sig == signal.SIGKILL else real_signal(self, sig))
    node = node_in(tmp_path)
    req = job(IGNORES_TERM, allocation_id=16, grace_period=0.2)

    pids = []

    async def scenario():
        env = ActivityEnvironment()
        task = asyncio.create_task(env.run(node.run_job, req))
        await printed(node, req)
        pids.append(node.processes[16].pid)
        env.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 10)
        return node.finished[16]

    try:
        result = run(scenario())
        assert (result.stopped, result.signal) == (True, signal.SIGKILL)
        assert node.lingering_gpus() == {3, 1}
        assert alive(pids[0]), "it lingers: the GPUs stay reported sick until it is gone"
        assert list(node.pid_dir.glob("16.json")), "kept for an agent started after this one to reap"
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGKILL)


def test_a_job_placed_on_a_gpu_processes_outliving_sigkill_still_hold_goes_back_without_running(tmp_path):
    """Placed before the next heartbeat reported the GPU sick: it must not start beside them."""
    class Stuck:
        def alive(self) -> bool:
            return True

    node = node_in(tmp_path)
    node.lingering[99] = (Stuck(), [1])
    req = job("print('ran', flush=True)", allocation_id=19)  # GPUs 3 and 1
    with pytest.raises(ApplicationError) as refused:
        run(ActivityEnvironment().run(node.run_job, req))
    assert refused.value.type == AGENT_FAULT and "[1]" in str(refused.value)
    assert "ran" not in (node._log_path(req).read_text() if node._log_path(req).exists() else "")


def test_a_gpu_that_an_ended_jobs_processes_still_hold_is_reported_sick():
    from workers.agent import LINGERING, with_lingering
    from workers.devices import GpuHealth

    health = [GpuHealth(index=0, healthy=True), GpuHealth(index=1, healthy=False, faults=["xid:79"])]
    assert with_lingering(health, set()) == health
    assert with_lingering(health, {0, 1}) == [GpuHealth(index=0, healthy=False, faults=[LINGERING]),
                                              GpuHealth(index=1, healthy=False, faults=["xid:79", LINGERING])]


def test_the_agent_logs_each_change_of_how_the_api_takes_its_heartbeats_once(tmp_path, caplog):
    """An agent started before its API, which then refused every heartbeat (a machine of more GPUs
    than a heartbeat may list), logged nothing: unreachable and refused were one state."""
    import httpx

    from workers.agent import Agent
    from workers.devices import FakeDevices
    from workers.settings import Settings

    answers = ["down", "down", 422, 422, 422, 200, 200, 401, "down"]

    def api(request: httpx.Request) -> httpx.Response:
        answer = answers.pop(0)
        if answer == "down":
            raise httpx.ConnectError("connection refused", request=request)
        return httpx.Response(answer, json={"detail": f"answer {answer}", "live_allocations": []})

    async def scenario():
        agent = Agent(MACHINE, Settings(api_url="http://api"), FakeDevices(2), node_in(tmp_path),
                      interval=0.05, orphan_grace=1.0)
        agent.http = httpx.AsyncClient(transport=httpx.MockTransport(api))
        for _ in range(9):
            await agent.heartbeat()
        await agent.close()

    with caplog.at_level("INFO", logger="gpusched.agent"):
        run(scenario())
    lines = [r.getMessage() for r in caplog.records if r.name == "gpusched.agent"]
    assert [" ".join(line.split()[:3]) for line in lines] == [
        "API unreachable at", "heartbeat refused: HTTP", "API answers heartbeats", "heartbeat refused: HTTP",
        "API unreachable at"]
    assert "HTTP 422" in lines[1] and "HTTP 401" in lines[3]


# --- rules a mutant could break unseen (a round of mutation testing) --------------------------------------


@pytest.mark.parametrize("name, make, exit_code, why", [
    ("a directory the agent may not enter fails the job with 126, saying so", "denied", 126, "Permission denied"),
    ("a file given as the working directory fails the job with 126, saying so", "file", 126, "not a directory"),
])
def test_a_working_directory_the_job_cannot_use_fails_it_at_once_naming_the_directory(
        tmp_path, monkeypatch, name, make, exit_code, why):
    """A user's error, not the machine's: failed at once with the reason, not queued again on
    machine after machine until five infrastructure failures end it."""
    where = tmp_path / "project"
    if make == "file":
        where.write_text("not a directory")
    else:  # the tests run as root, who may enter anything: the refusal is made up
        real_stat = os.stat

        def refusing(path, *args, **kwargs):
            if os.fspath(path) == str(where):
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(where))
            return real_stat(path, *args, **kwargs)

        monkeypatch.setattr(os, "stat", refusing)
    result = run(ActivityEnvironment().run(node_in(tmp_path).run_job, job("print('never')", working_dir=str(where))))
    assert result.exit_code == exit_code
    assert f"working directory cannot be used on machine {MACHINE} ({why})" in result.last_log_lines[0]


def test_a_shorter_stop_after_a_cancel_cuts_the_launch_grace_short(tmp_path):
    """A later request may only shorten the grace: an orphan's kill (or the agent's shutdown)
    after a preemption with a long grace must not wait the long grace out."""
    node = node_in(tmp_path)
    req = job(IGNORES_TERM, allocation_id=19, grace_period=30)

    async def scenario():
        env = ActivityEnvironment()
        task = asyncio.create_task(env.run(node.run_job, req))
        await printed(node, req)
        start = time.monotonic()
        env.cancel()  # stops with the launch's 30 s grace
        await asyncio.sleep(0.1)
        await node.kill_allocation(19, 0.3)
        with contextlib.suppress(BaseException):
            await task
        return time.monotonic() - start

    assert run(scenario()) < 5
    assert (node.finished[19].signal, node.finished[19].stopped) == (signal.SIGKILL, True)


SAVES_ON_TERM = """
import signal, sys, time
def save(*_):
    time.sleep(0.5)
    print("saved", flush=True)
    sys.exit(0)
signal.signal(signal.SIGTERM, save)
print("ready", flush=True)
time.sleep(30)
"""


@pytest.mark.parametrize("name, code, grace, ends_with, printed_last", [
    ("a process that ignores SIGTERM is killed once its grace is over", IGNORES_TERM.replace("running", "ready"),
     0.3, -signal.SIGKILL, None),
    ("a process that checkpoints on SIGTERM is given its grace to finish", SAVES_ON_TERM, 5, 0, "saved"),
])
def test_a_process_left_by_an_earlier_agent_gets_sigterm_its_grace_then_sigkill(
        tmp_path, name, code, grace, ends_with, printed_last):
    from activities.run_processes import start_ticks

    node = node_in(tmp_path)
    node.pid_dir.mkdir(parents=True)
    leftover = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], start_new_session=True,
                                stdout=subprocess.PIPE, text=True)
    assert leftover.stdout.readline() == "ready\n"
    (node.pid_dir / "21.json").write_text(json.dumps(
        {"pid": leftover.pid, "allocation_id": 21, "job_id": "old", "start_ticks": start_ticks(leftover.pid),
         "gpus": [0]}))
    try:
        assert run(node.reap_leftovers(grace=grace)) == [21]
        assert leftover.wait(timeout=2) == ends_with
        assert (leftover.stdout.read().strip() or None) == printed_last
        assert node.lingering_gpus() == set() and not list(node.pid_dir.iterdir())
    finally:
        if leftover.poll() is None:
            leftover.kill()
        leftover.stdout.close()


@pytest.mark.parametrize("name, recorded_ticks, boot, reaped", [
    ("the recorded leader, its start time matching, is reaped", "its own", "this", True),
    ("a live process whose start time is not the recorded leader's is another's now, and not signalled",
     "another", "this", False),
    ("a pid file of an earlier boot is not acted on even where its pid and start time name a live process",
     "its own", "another", False),
])
def test_a_pid_file_signals_its_pid_only_while_it_is_still_the_runs_leader(tmp_path, name, recorded_ticks, boot,
                                                                         reaped):
    """Pids are reused: after a reboot, or after long enough, the pid an earlier agent recorded
    names another user's process, which an agent coming up must not SIGTERM and SIGKILL."""
    from activities.run_processes import boot_id, start_ticks

    node = node_in(tmp_path)
    node.pid_dir.mkdir(parents=True)
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], start_new_session=True)
    ticks = start_ticks(process.pid)
    (node.pid_dir / "22.json").write_text(json.dumps(
        {"pid": process.pid, "allocation_id": 22, "job_id": "old",
         "start_ticks": ticks if recorded_ticks == "its own" else ticks + 1,
         "boot_id": boot_id() if boot == "this" else "an-earlier-boot"}))
    try:
        assert run(node.reap_leftovers(grace=1)) == ([22] if reaped else [])
        time.sleep(0.2)
        assert (process.poll() is not None) is reaped
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()


def test_a_member_of_a_runs_group_that_cleared_its_environment_is_reaped_with_the_group(tmp_path):
    """The leader gone, a member carrying the run's token shows the group is still the run's:
    the whole group is signalled, not only the members the token finds."""
    from activities.run_processes import boot_id

    token = "f00d" * 6
    node = node_in(tmp_path)
    node.pid_dir.mkdir(parents=True)
    code = ("import os, subprocess, sys; sleep = [sys.executable, '-c', 'import time; time.sleep(30)']; "
            "marked = subprocess.Popen(sleep, stdout=subprocess.DEVNULL); "
            "clean = subprocess.Popen(sleep, stdout=subprocess.DEVNULL, "
            "env={k: v for k, v in os.environ.items() if k != 'GPUSCHED_RUN_TOKEN'}); "
            "print(os.getpid(), marked.pid, clean.pid, flush=True)")
    leader = subprocess.Popen([sys.executable, "-c", code], start_new_session=True, stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "GPUSCHED_RUN_TOKEN": token})
    pgid, marked, clean = map(int, leader.stdout.readline().split())
    leader.wait(timeout=5)
    leader.stdout.close()
    deadline = time.monotonic() + 5
    while token.encode() not in open(f"/proc/{marked}/environ", "rb").read() and time.monotonic() < deadline:
        time.sleep(0.01)
    (node.pid_dir / "23.json").write_text(json.dumps(
        {"pid": pgid, "allocation_id": 23, "job_id": "old", "start_ticks": 12345, "token": token,
         "boot_id": boot_id()}))
    try:
        assert run(node.reap_leftovers(grace=1)) == [23]
        time.sleep(0.2)
        assert not still_runs(marked) and not still_runs(clean)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)


class FakeNode:
    """What the agent asks of its node: the local allocations, and a kill it records."""

    def __init__(self, running: list[int]):
        self.processes = {a: object() for a in running}
        self.killed: list[int] = []

    def live_allocations(self) -> list[int]:
        return sorted(self.processes)

    def lingering_gpus(self) -> set[int]:
        return set()

    async def kill_allocation(self, alloc: int, grace: float) -> str:
        self.killed.append(alloc)
        self.processes.pop(alloc, None)
        return "stopped"


def agent_beating_to(answer: dict, beats: list, node=None):
    """An agent of MACHINE whose API records each heartbeat's body in `beats` and answers `answer`."""
    import httpx

    from workers.agent import Agent
    from workers.devices import FakeDevices
    from workers.settings import Settings

    def api(request: httpx.Request) -> httpx.Response:
        beats.append(json.loads(request.content))
        return httpx.Response(200, json=answer)

    agent = Agent(MACHINE, Settings(api_url="http://api"), FakeDevices(2), node or FakeNode([]),
                  interval=60, orphan_grace=1.0)
    agent.http = httpx.AsyncClient(transport=httpx.MockTransport(api))
    return agent


async def settled(agent) -> None:
    """Until the heartbeats and kills the agent sent off in the background are done."""
    while agent._tasks:
        await asyncio.gather(*list(agent._tasks))


# (sentence, the worker polls, Temporal answers, the heartbeat says it takes work)
TAKES_WORK = [
    ("an agent whose worker polls and whose Temporal answers takes work", True, True, True),
    ("an agent whose Temporal does not answer takes none", True, False, False),
    ("an agent whose worker does not poll yet takes none", False, True, False),
]


@pytest.mark.parametrize("sentence, serving, temporal_ok, accepting", TAKES_WORK, ids=[r[0] for r in TAKES_WORK])
def test_an_agent_says_it_takes_work_only_while_its_worker_polls_and_temporal_answers(sentence, serving,
                                                                                      temporal_ok, accepting):
    beats = []

    async def scenario():
        agent = agent_beating_to({"live_allocations": []}, beats)
        agent.serving, agent.temporal_ok = serving, temporal_ok
        await agent.heartbeat()
        await agent.close()

    run(scenario())
    assert [b["accepting_work"] for b in beats] == [accepting]


def test_an_agent_that_begins_to_shut_down_says_at_once_that_it_takes_no_more_work():
    """SIGTERM: the scheduler must hear it before the next regular beat, or it places a job on a
    worker that no longer polls."""
    beats = []

    async def scenario():
        agent = agent_beating_to({"live_allocations": []}, beats)
        agent.serving = True
        agent.stop_taking_work()  # what the SIGTERM handler calls
        await settled(agent)
        await agent.heartbeat()  # and every regular one after
        await agent.close()

    run(scenario())
    assert [b["accepting_work"] for b in beats] == [False, False]


def test_an_agent_stops_an_allocation_the_api_left_out_of_two_regular_answers_in_a_row_and_no_sooner():
    """One odd answer kills nothing; nor does a heartbeat sent beside the regular ones (a change of
    whether the machine takes work, a failing GPU) count toward the two."""
    beats = []

    async def scenario():
        node = FakeNode([21])
        agent = agent_beating_to({"live_allocations": []}, beats, node)
        await agent.heartbeat()  # first miss
        await settled(agent)
        after_one = list(node.killed)
        agent.beat_now()  # sent beside: not counted
        await settled(agent)
        after_beside = list(node.killed)
        await agent.heartbeat()  # second regular miss in a row
        await settled(agent)
        await agent.close()
        return after_one, after_beside, node.killed

    assert run(scenario()) == ([], [], [21])
    assert all(b["running_allocations"] == [21] for b in beats)


@pytest.mark.parametrize("forward", ["forward_checkpoint", "forward_restart"])
def test_a_report_the_api_refuses_for_the_machine_s_token_is_sent_again_not_taken_as_a_verdict(forward):
    """A 403 (the machine's token, while tokens are rolled out) judges nothing about the report."""
    import httpx

    from workers import agent as agent_module

    async def scenario():
        http = httpx.AsyncClient(transport=httpx.MockTransport(
            lambda request: httpx.Response(403, json={"detail": "the token of machine 'c1/b0/r0/m0' ..."})))
        try:
            return await getattr(agent_module, forward)(http, "http://api", "train-1", 7, {"seq": 1, "seconds": 2})
        finally:
            await http.aclose()

    with pytest.raises(httpx.HTTPStatusError):
        run(scenario())
