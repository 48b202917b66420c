"""The job commands on the command line: refusals are one line naming the field, with exit code 2;
an unreachable stack is one line with exit code 1; never a traceback."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from datetime import datetime, timezone
from types import SimpleNamespace

import asyncpg
import pytest
from temporalio.client import (
    WorkflowExecutionStatus,
    WorkflowFailureError,
    WorkflowQueryFailedError,
    WorkflowUpdateFailedError,
)
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError, RPCStatusCode

from workers.arg_types import deadline
from workers.cli import main
from workers.cli_jobs import _print_view, _when, list_table
from workers.client import ClientError, GpuschedClient, NotYetAdmitted
from scheduler.models import Priority, Quota
from workflows.types import JOB_FAILED, AttemptView, JobView


@pytest.mark.parametrize("argv", [
    ["status", "caf\udce9"], ["cancel", "caf\udce9"], ["wait", "caf\udce9"], ["logs", "caf\udce9"],
    ["bump", "caf\udce9", "--priority", "low"], ["list", "--team", "caf\udce9"],
    ["quota", "set", "caf\udce9", "--guaranteed", "1"], ["cluster", "set", "caf\udce9", "--machine-timeout", "30"],
], ids=["status", "cancel", "wait", "logs", "bump", "list --team", "quota set", "cluster set"])
def test_a_name_typed_in_another_encoding_is_refused_naming_its_argument(capsys, argv, tmp_path):
    """Before, it reached the database: 'cannot store a value of this request (... surrogates not
    allowed)', naming neither the argument nor the fix."""
    with pytest.raises(SystemExit) as exit_:
        main(argv + ["--data-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "holds bytes that are not UTF-8; type it in a UTF-8 locale" in err
    assert ("argument job_id" in err or "argument --team" in err or "argument team" in err
            or "argument cluster" in err), err


@pytest.mark.parametrize("argv, words", [
    (["submit", "--team", "vision", "--gpus", "0", "--", "true"], "num_gpus"),
    (["submit", "--team", "vision", "--gpus", "1"], "command: no command to run; give it after --"),
    (["submit", "--team", "vision", "--gpus", "1", "--env", "NOEQUALS", "--", "true"], "env"),
    (["submit", "--team", "vision", "--gpus", "1", "--job-id", "bad id!", "--", "true"], "job_id"),
    (["submit", "--team", "vision", "--gpus", "1", "--max-retries", "-1", "--", "true"],
     "max_retries: "),
    (["submit", "--team", " ", "--gpus", "1", "--", "true"], "team: is blank"),
    (["submit", "--team", "vision", "--gpus", "1", "--gpu-type", "", "--", "true"], "gpu_type: is blank"),
    (["submit", "--team", "vision", "--gpus", "1", "--checkpoint-interval", "1e-9", "--", "true"],
     "at least 1 second (--checkpoint-interval)"),
    (["submit", "--team", "vision", "--gpus", "1", "--", ""], "command: starts with an empty word"),
    (["submit", "--team", "vision", "--gpus", "1", "--env", "=x", "--", "true"], "env: --env '=x' is not NAME=VALUE"),
    (["submit", "--team", "vision", "--gpus", "1", "--env", "A=x\0y", "--", "true"], "env: variable A holds a NUL"),
    (["submit", "--team", "vision", "--gpus", "1", "--env", "CUDA_VISIBLE_DEVICES=0,1", "--", "true"],
     "env: sets CUDA_VISIBLE_DEVICES, which the agent sets for each attempt"),
    (["submit", "--team", "vision", "--gpus", "1", "--env", "GPUSCHED_RESUME_FROM=s3://b/x", "--", "true"],
     "env: sets GPUSCHED_RESUME_FROM, which the agent sets"),
    # jobkit's settings are the job's (GPUSCHED_S3_RETRY_S): let through to a later check's refusal.
    (["submit", "--team", "vision", "--gpus", "1", "--env", "GPUSCHED_S3_RETRY_S=900", "--checkpoint-interval",
      "1e-9", "--", "true"], "at least 1 second (--checkpoint-interval)"),
    (["submit", "--team", "vision", "--gpus", "1", "--env", "MY VAR=1", "--", "true"],
     "env: has the variable name 'MY VAR'; a name holds no spaces"),
    (["submit", "--team", "vision", "--gpus", "1", "--", "echo", "a\0b"], "command: holds a NUL"),
    (["submit", "--team", "vision", "--gpus", "1", "--", "python", "caf\udce9.py"],
     "command: holds bytes that are not UTF-8"),
    (["submit", "--team", "vision", "--gpus", "1", "--env", "A=caf\udce9", "--", "true"],
     "env: variable 'A': holds bytes that are not UTF-8"),
    (["submit", "--team", "vision", "--gpus", "1", "--workdir", "/data/caf\udce9", "--", "true"],
     "working_dir: holds bytes that are not UTF-8"),
    (["submit", "--team", "vision", "--gpus", "1", "--workdir", "/data/x\0y", "--", "true"],
     "working_dir: holds a NUL"),
    (["submit", "--team", "vision", "--gpus", "1", "--gpu-type", "H\udce9", "--", "true"],
     "gpu_type: holds bytes that are not UTF-8"),
    (["submit", "--team", "vision", "--gpus", "1", "--env", "CAF\udce9=1", "--", "true"],
     "env: variable name 'CAF\\udce9': holds bytes that are not UTF-8"),
    (["submit", "--team", "vision", "--gpus", "1", "--env", "A=1", "B=2", "--", "python", "train.py"],
     "command: starts with 'B=2', a variable's assignment, not a program; set each variable with its own --env"),
    (["submit", "--team", "vision", "--gpus", "2147483648", "--", "true"], "num_gpus: is 2147483648"),
    (["submit", "--team", "vision", "--gpus", "1", "--cluster", " ", "--", "true"], "cluster: is blank"),
    (["quota", "set", "vision", "--guaranteed", "3000000000"], "--guaranteed"),
    (["list", "--limit", "9223372036854775808"], "--limit"),
    (["quota", "set", "vision", "--guaranteed", "8", "--max", "4"],
     "error: max: max (4) is below guaranteed (8); give --max at least --guaranteed"),
    (["quota", "set", "vision", "--guaranteed", "-1"], "give --guaranteed a valid value"),
    (["quota", "set", " ", "--guaranteed", "8"], "team: is blank"),
    (["cluster", "set", "c1", "--policy", "grace_period=abc"], "grace_period=abc"),
    (["cluster", "set", "c1", "--policy", "min_runtime=-5"], "min_runtime=-5"),
    (["cluster", "set", "c1", "--policy", "grace_period=30", "min_runtime=-5"], "min_runtime=-5"),
    (["cluster", "set", "c1", "--policy", "checkpoint_slot=1e-300"], "checkpoint_slot=1e-300: Input should be greater"),
    (["cluster", "set", "c1", "--policy", "grace_period=1e308"], "grace_period=1e308: Input should be less"),
    (["cluster", "set", "c1", "--policy", "max_preemption_searches=1000000000"], "max_preemption_searches="),
    (["cluster", "set", "c1", "--policy", "eta_horizon=1e-300"], "eta_horizon=1e-300"),
    (["cluster", "set", "c1", "--machine-timeout", "1e-300"], "give --machine-timeout 7 to 86400 seconds"),
    (["cluster", "set", "c1", "--machine-timeout", "6"], "give --machine-timeout 7 to 86400 seconds"),
], ids=[
    "a job of no GPUs",
    "a job without a command",
    "an environment variable without a value",
    "a job id with spaces",
    "a negative number of retries",
    "a blank team",
    "a blank GPU type",
    "a checkpoint interval too short to mean anything",
    "a command that starts with an empty word",
    "an environment variable without a name",
    "an environment value with a NUL character",
    "the GPUs a job is pinned to are the agent's to set",
    "the agent's own variables are the agent's to set",
    "jobkit's own settings are the job's to set",
    "an environment variable name with a space",
    "a command word with a NUL character",
    "a command word in another encoding than UTF-8 (a Latin-1 file name)",
    "an environment value in another encoding",
    "a working directory in another encoding",
    "a working directory with a NUL character",
    "a GPU type in another encoding",
    "an environment variable's name in another encoding",
    "a second variable after one --env becomes the command, which is refused",
    "more GPUs than any fleet has",
    "a blank cluster",
    "a guarantee too big to store",
    "a list limit too big to store",
    "a maximum below the guarantee",
    "a negative guarantee names its flag",
    "a quota for a blank team, said without a stack to ask",
    "a policy knob that is not a number",
    "a negative policy knob",
    "every knob after one --policy is checked",
    "a checkpoint slot too fine to plan",
    "a grace period no job would live to see end",
    "preemption searches past any cycle's time",
    "an estimate horizon of no time",
    "a machine timeout shorter than a heartbeat",
    "a machine timeout an API restart would outlast",
])
def test_a_bad_request_is_refused_before_anything_is_sent(capsys, argv, words, tmp_path):
    try:
        code = main(argv + ["--data-dir", str(tmp_path)] if argv[0] in ("quota", "cluster", "list") else argv)
    except SystemExit as e:  # argparse refused a flag
        code = e.code
    assert code == 2
    err = capsys.readouterr().err
    # One error line of ours, or argparse's usage and its error line for a flag it refused.
    assert (err.startswith("error:") or ": error: argument " in err) and words in err and "Traceback" not in err


def _view(**fields) -> JobView:
    defaults = dict(job_id="j", team="vision", priority="normal", num_gpus=4, cluster="c1",
                    command=["true"], submitted_at="2026-12-01T00:00:00+00:00")
    return JobView(**{**defaults, **fields})


WAITS = "needs 4 GPUs; 2 are free, expected to start in 1.0 min"
REQUEUED = "preempted: team speech reclaims capacity team vision borrowed, for job c"


@pytest.mark.parametrize("view, shown, not_shown", [
    (_view(state="queued", reason=WAITS, pending_reason=WAITS, position=1),
     ["  waiting: " + WAITS], ["reason:", "back in the queue"]),
    (_view(state="queued", reason=REQUEUED, pending_reason=WAITS, position=1),
     ["  waiting: " + WAITS, "  back in the queue: " + REQUEUED], ["reason:"]),
    (_view(state="running", reason=REQUEUED),
     ["  last requeued: " + REQUEUED], ["reason:", "waiting:"]),
    (_view(state="running", reason="requeued: the agent failed"),
     ["  last requeued: the agent failed"], ["requeued: requeued"]),
    (_view(state="failed", reason="the command failed with exit code 3", exit_code=3),
     ["  reason: the command failed with exit code 3", "  exit code: 3"], ["waiting:"]),
], ids=[
    "a job queued from the start says once why it waits",
    "a preempted job back in the queue says why it waits now and why it went back",
    "a job running again says why it last went back to the queue, not as the reason it runs",
    "a requeue reason is not prefixed twice",
    "a failed job says why it failed",
])
def test_status_says_why_a_job_waits_apart_from_why_it_was_requeued(capsys, view, shown, not_shown):
    _print_view(view)
    out = capsys.readouterr().out
    assert all(line in out.splitlines() for line in shown), out
    assert not any(words in out for words in not_shown), out


@pytest.mark.parametrize("view, line", [
    (_view(state="queued", estimated_start="2999-01-01T00:00:00+00:00"),
     "  held back, starts 2999-01-01T00:00:00+00:00 (in "),
    (_view(state="queued", position=1, deadline="2999-01-01T00:00:00+00:00", misses_deadline=True),
     "  deadline hint 2999-01-01T00:00:00+00:00 (in "),
    (_view(state="running", preemptions=2), "  preempted 2 times"),
    (_view(state="running", preemptions=1), "  preempted 1 time"),
    (_view(state="checkpointing", attempts=[AttemptView(
        attempt=1, allocation_id=7, gpus=["c1/b0/r0/m0/0"], started_at="2026-12-01T00:00:00+00:00", ended_at=None,
        end_reason=None, stopping="preempted: critical job c needs its GPUs", stop_by="2999-01-01T00:00:00+00:00")]),
     "    stopping: preempted: critical job c needs its GPUs (its grace ends 2999-01-01T00:00:00+00:00 (in "),
], ids=[
    "a held-back job says the earliest it starts, as the list does",
    "a job with a deadline hint says it and whether it is expected to miss it",
    "a job preempted twice says so",
    "once, in the singular",
    "an attempt told to stop says why, and when its grace ends",
])
def test_status_says_when_a_held_back_job_may_start_its_deadline_and_its_preemptions(capsys, view, line):
    _print_view(view)
    out = capsys.readouterr().out
    assert any(shown.startswith(line) for shown in out.splitlines()), out
    if view.misses_deadline:
        assert "; expected to miss it" in out, out


@pytest.mark.parametrize("iso, when", [
    (None, "unknown"),
    ("2026-12-01T00:00:45+00:00", "2026-12-01T00:00:45+00:00 (in 45 s)"),
    ("2026-11-30T23:59:00+00:00", "2026-11-30T23:59:00+00:00 (now)"),
], ids=["no estimate is unknown", "an estimate ahead says how far", "an estimate passed says now"])
def test_an_estimated_start_is_said_as_a_date_and_from_now(iso, when):
    assert _when(iso, datetime.fromisoformat("2026-12-01T00:00:00+00:00").timestamp()) == when


def test_the_job_list_is_a_table_that_says_when_queued_jobs_should_start():
    views = [_view(job_id="pretrain-a-183659", state="running", num_gpus=8),
             _view(job_id="j", state="queued", position=1, estimated_start="2026-12-01T00:10:00+00:00"),
             _view(job_id="k", state="queued", position=2),
             _view(job_id="held", state="queued", estimated_start="2026-12-01T00:02:00+00:00"),
             _view(job_id="late", state="queued", position=3, estimated_start="2026-12-01T01:00:00+00:00",
                   misses_deadline=True)]
    now = datetime.fromisoformat("2026-12-01T00:00:00+00:00").timestamp()
    assert list_table(views, now).splitlines() == [
        "JOB                STATE    TEAM    PRIORITY  GPUS  QUEUED",
        "pretrain-a-183659  running  vision  normal       8",
        "j                  queued   vision  normal       4  #1, starts in 10.0 min",
        "k                  queued   vision  normal       4  #2",
        "held               queued   vision  normal       4  held back, starts in 2.0 min at the earliest",
        "late               queued   vision  normal       4  #3, starts in 60.0 min, misses its deadline",
    ]


@pytest.mark.parametrize("typed, seconds_from_now, at", [
    ("+90m", 5400, None), ("+6h", 21600, None), ("+2d", 172800, None), ("+3600s", 3600, None),
    ("+1.5H", 5400, None), ("2030-01-01T00:00:00+00:00", None, datetime(2030, 1, 1, tzinfo=timezone.utc)),
], ids=["minutes", "hours", "days", "seconds", "a fraction, the unit in capitals", "a date and time with its zone"])
def test_a_deadline_is_typed_as_a_time_from_now_or_a_date(typed, seconds_from_now, at):
    if at is not None:
        assert deadline(typed) == at.timestamp()
    else:
        assert deadline(typed) - time.time() == pytest.approx(seconds_from_now, abs=5)


@pytest.mark.parametrize("argv, words", [
    (["list", "--state", "bogus"], "argument --state: invalid choice: 'bogus'"),
    (["list", "--limit", "-1"], "argument --limit: must be 1 or more"),
    (["list", "--limit", "ten"], "argument --limit: not a whole number"),
    (["wait", "j", "--timeout", "-1"], "argument --timeout: must be above 0"),
    (["logs", "j", "--attempt", "0"], "argument --attempt: must be 1 or more"),
    (["submit", "--team", "vision", "--gpus", "1", "--expected-duration", "inf", "--", "true"],
     "argument --expected-duration: must be a finite number, not inf"),
    (["cluster", "set", "c1", "--machine-timeout", "nan"], "argument --machine-timeout: must be a finite number"),
    (["submit", "--team", "vision", "--gpus", "1", "--deadline", "tomorrow", "--", "true"],
     "argument --deadline: 'tomorrow' is neither a date and time (2026-12-08T09:00) nor a time from now (+6h)"),
    (["submit", "--team", "vision", "--gpus", "1", "--deadline", "+6y", "--", "true"],
     "argument --deadline: '+6y' is not a time from now; write it as +90m, +6h or +2d"),
    (["submit", "--team", "vision", "--gpus", "1", "--deadline", "+-1h", "--", "true"],
     "argument --deadline: '+-1h' is not a time from now"),
    (["submit", "--team", "vision", "--gpus", "1", "--deadline", "9999-12-31", "--", "true"],
     "argument --deadline: '9999-12-31' is not between 1970-01-01 and 2096-10-02; give a date and time"),
    (["submit", "--team", "vision", "--gpus", "1", "--deadline", "+1000000d", "--", "true"],
     "argument --deadline: '+1000000d' is not between 1970-01-01 and 2096-10-02"),
], ids=[
    "listing by a state that does not exist names the states there are",
    "a negative limit is refused before the database sees it",
    "a limit that is not a number is refused",
    "a wait with a negative timeout is refused, not reported as timed out",
    "attempt 0 is refused, not taken for the last one",
    "an endless expected duration",
    "a machine timeout that is not a number",
    "a deadline in words",
    "a deadline from now in an unknown unit",
    "a deadline from now that is in the past",
    "a date past the last a deadline may name, said as dates (not as epoch seconds)",
    "a time from now past it",
])
def test_a_bad_flag_is_a_usage_error(capsys, argv, words):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and words in err and "Traceback" not in err


def test_a_reader_that_goes_away_ends_the_command_quietly():
    """`gpusched list | head`: when the pipe's reader has closed, the command stops with exit
    code 1 and no traceback."""
    read, write = os.pipe()
    os.close(read)  # the reader is gone before anything is written
    try:
        done = subprocess.run([sys.executable, "-m", "workers.cli", "example-job", "--steps", "2", "--step-seconds", "0"],
                              stdout=write,
                              stderr=subprocess.PIPE, text=True, timeout=60)
    finally:
        os.close(write)
    assert done.returncode == 1 and "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr


@pytest.mark.parametrize("argv, code, stream, words", [
    (["example-job", "--steps", "1", "--step-seconds", "0"], 0, "stdout", "example-job: done, steps=1"),
    (["--help"], 0, "stdout", "usage: gpusched"),
    (["submit", "--gpus", "1", "--", "true"], 2, "stderr", "the following arguments are required: --team"),
    (["trace", "generate", "--out", "/nonexistent-dir/t.csv", "--jobs", "1"], 2, "stderr", "error:"),
], ids=["what a command prints reaches a pipe, and its exit code is main's",
        "--help prints the usage and exits 0",
        "a flag argparse refuses exits 2 with its message",
        "a user error exits 2 with one line"])
def test_the_gpusched_command_exits_with_mains_code_and_everything_it_wrote(argv, code, stream, words):
    """It skips the interpreter's teardown, where the Temporal client's threads crashed about one
    exit in forty (temporalio/sdk-python#300): nothing it wrote may be lost on the way."""
    done = subprocess.run([sys.executable, "-c", "from workers.cli import console_main; console_main()", *argv],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == code, (done.stdout[-500:], done.stderr[-500:])
    assert words in getattr(done, stream) and "Traceback" not in done.stderr


def test_a_folder_without_a_stack_is_not_taken_for_the_stack_on_the_default_ports(capsys, monkeypatch, tmp_path):
    for var in [v for v in os.environ if v.startswith("GPUSCHED_")]:
        monkeypatch.delenv(var)
    assert main(["list", "--data-dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert f"no gpusched stack in {tmp_path}" in err and "Traceback" not in err


def test_without_a_folder_named_the_default_one_must_hold_a_stack_too(capsys, monkeypatch, tmp_path):
    """Before, a command with no --data-dir and nothing in ~/.gpusched went to the default local
    ports: another stack's there answered for it (or a password error named a setting never set)."""
    for var in [v for v in os.environ if v.startswith("GPUSCHED_")]:
        monkeypatch.delenv(var)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert main(["list"]) == 1
    err = capsys.readouterr().err
    assert f"no gpusched stack in {tmp_path / '.gpusched'}; start one with `gpusched dev up`" in err
    assert "--data-dir" in err and "Traceback" not in err


def test_an_unreachable_stack_is_one_line_and_exit_code_1(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("GPUSCHED_PG_DSN", "postgresql://postgres@127.0.0.1:9/gpusched")
    assert main(["list", "--data-dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "cannot reach the gpusched stack" in err and "gpusched dev up" in err and "Traceback" not in err


@pytest.mark.parametrize("dsn, code, words", [
    ("notadsn", 2, "GPUSCHED_PG_DSN or GPUSCHED_TEMPORAL_ADDRESS cannot be used"),
    ("postgresql://postgres@127.0.0.1:99999/x", 2, "port must be"),
], ids=["a DSN that is not one", "a port no address has"])
def test_a_database_address_no_client_can_use_is_one_line(capsys, monkeypatch, tmp_path, dsn, code, words):
    monkeypatch.setenv("GPUSCHED_PG_DSN", dsn)
    assert main(["list", "--data-dir", str(tmp_path)]) == code
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err and err.count("\n") == 1


def test_a_database_that_takes_the_connection_and_never_answers_fails_in_seconds(capsys, monkeypatch, tmp_path):
    import socket
    import time

    from workers import client

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen()
    monkeypatch.setattr(client, "CONNECT_TIMEOUT", 1.0)
    monkeypatch.setenv("GPUSCHED_PG_DSN", f"postgresql://postgres@127.0.0.1:{silent.getsockname()[1]}/x")
    began = time.monotonic()
    try:
        assert main(["list", "--data-dir", str(tmp_path)]) == 1
    finally:
        silent.close()
    assert time.monotonic() - began < 10
    err = capsys.readouterr().err
    assert "cannot reach the gpusched stack (no answer in time)" in err and "Traceback" not in err


@pytest.mark.parametrize("team", ["", "  ", "a\x01b", "a\nb", "x" * 129],
                         ids=["empty", "blank", "a control character", "a newline", "too long"])
def test_a_quota_for_a_team_name_no_job_could_carry_is_refused(team):
    import asyncio

    from workers.client import ClientError, GpuschedClient

    with pytest.raises(ClientError) as refused:
        asyncio.run(GpuschedClient(None, None, None).set_quota(team, Quota(guaranteed=1)))
    assert refused.value.field == "team"


@pytest.mark.live
@pytest.mark.parametrize("argv", [["quota", "set", "vision", "--guaranteed", "8", "--data-dir", "D"],
                                  ["list", "--data-dir", "D"],
                                  ["submit", "--team", "vision", "--gpus", "1", "--data-dir", "D", "--", "true"]],
                         ids=["setting a quota", "listing jobs", "submitting"])
def test_a_database_no_control_worker_has_migrated_is_one_line_saying_to_start_one(
        live_servers, capsys, monkeypatch, tmp_path, argv):
    monkeypatch.setenv("GPUSCHED_PG_DSN", live_servers.new_database())
    monkeypatch.setenv("GPUSCHED_TEMPORAL_ADDRESS", live_servers.temporal_address)
    assert main([str(tmp_path) if word == "D" else word for word in argv]) == 1
    err = capsys.readouterr().err
    assert "control worker" in err and "Traceback" not in err


@pytest.mark.live
@pytest.mark.parametrize("given, expected", [
    (None, "{cwd}"),
    ("data/run", "{cwd}/data/run"),
    ("/shared/project", "/shared/project"),
    ("none", None),
], ids=["a job runs where it was submitted from, as with Slurm's sbatch",
        "a relative --workdir is taken from where submit runs",
        "an absolute --workdir is the job's as given",
        "--workdir none runs it in the agent's own directory (a submit from outside the fleet)"])
def test_the_working_directory_a_submit_gives_its_job(monkeypatch, tmp_path, given, expected):
    from workers.cli_jobs import _working_dir

    monkeypatch.chdir(tmp_path)
    assert _working_dir(given) == (expected.format(cwd=os.getcwd()) if expected else None)


def test_a_submits_deadline_reaches_its_request():
    from workers.cli import build_parser
    from workers.cli_jobs import _request

    args = build_parser().parse_args(["submit", "--team", "vision", "--gpus", "1", "--deadline", "+2h", "--", "true"])
    assert _request(args).deadline == pytest.approx(time.time() + 7200, abs=5)


def test_a_relative_working_directory_is_refused_by_the_api_naming_the_field():
    from workflows.types import JobRequest, request_problem

    request = JobRequest(job_id="j", team="vision", num_gpus=1, command=["true"], working_dir="data/run")
    assert request_problem(request) == ("working_dir", "is 'data/run', a relative path; give an absolute one "
                                                       "(the machine's directory the command runs in)")


def test_the_commands_on_a_live_stack(stack, capsys):
    s = stack(machines=1, gpus=4, policy={"retry_backoff": 600})
    d = ["--data-dir", str(s.data_dir)]
    assert main(["submit", "--team", "nobody", "--gpus", "1", *d, "--", "true"]) == 2
    assert "has no quota" in capsys.readouterr().err
    assert main(["submit", "--team", "vision", "--gpus", "2", "--job-id", "cli-1", "--json", *d, "--", "true"]) == 0
    submitted = json.loads(capsys.readouterr().out)
    assert submitted["job_id"] == "cli-1" and {"position", "estimated_start"} <= set(submitted)
    assert main(["wait", "cli-1", "--timeout", "60", *d]) == 0
    capsys.readouterr()
    assert main(["status", "cli-1", "--json", *d]) == 0
    view = json.loads(capsys.readouterr().out)
    assert view["state"] == "succeeded" and view["exit_code"] == 0
    [attempt] = view["attempts"]
    assert {"allocation_id", "gpus", "started_at", "ended_at", "end_reason", "resumed_from"} <= set(attempt)
    assert main(["logs", "cli-1", *d]) == 0
    assert "job=cli-1" in capsys.readouterr().out
    assert main(["logs", "cli-1", "--attempt", "2", *d]) == 2
    project = s.data_dir.parent / "project"  # a job's relative paths are its working directory's
    project.mkdir()
    (project / "train.py").write_text("import os; print('ran in', os.getcwd())\n")
    assert main(["submit", "--team", "vision", "--gpus", "1", "--job-id", "cli-wd", "--workdir", str(project),
                 *d, "--", sys.executable, "train.py"]) == 0
    assert main(["wait", "cli-wd", "--timeout", "60", *d]) == 0
    capsys.readouterr()
    assert main(["logs", "cli-wd", *d]) == 0
    assert f"ran in {project}" in capsys.readouterr().out
    assert main(["status", "nope", *d]) == 2
    assert "no job 'nope'" in capsys.readouterr().err
    assert main(["submit", "--team", "vision", "--gpus", "1", "--job-id", "cli-2", *d, "--", "sh", "-c", "exit 3"]) == 0
    assert main(["wait", "cli-2", "--timeout", "60", *d]) == 3  # ended, not succeeded: not 1, a stack not answering
    assert main(["list", "--state", "failed", "--json", *d]) == 0
    out = capsys.readouterr().out
    assert [v["job_id"] for v in json.loads(out[out.index("["):])] == ["cli-2"]
    # The same submit again, for a job that has ended: it says how it ended, not "placed".
    assert main(["submit", "--team", "vision", "--gpus", "1", "--job-id", "cli-2", *d, "--", "sh", "-c", "exit 3"]) == 0
    assert capsys.readouterr().out.startswith("cli-2: already failed on c1")
    # ... and for a job that runs: since when, not "placed ... estimated start <its start> (now)".
    under_way = ["submit", "--team", "vision", "--gpus", "1", "--job-id", "cli-run", *d, "--", "sleep", "30"]
    assert main(under_way) == 0
    s.until(lambda: s.status("cli-run").state == "running")
    capsys.readouterr()
    assert main(["wait", "cli-run", "--timeout", "0.5", *d]) == 124  # as timeout(1): still running, not failed
    assert "cli-run had not ended after 0.5 s" in capsys.readouterr().err
    assert main(["wait", "cli-run", "--timeout", "0.5", "--json", *d]) == 124
    assert json.loads(capsys.readouterr().out)["state"] == "running"  # the job as it is, not nothing
    assert main(["bump", "cli-run", "--priority", "high", *d]) == 0
    capsys.readouterr()
    assert main(under_way) == 0
    said = capsys.readouterr()
    assert said.out.startswith("cli-run: already running on c1 since 20")
    # Sent again after a bump: the job keeps the bumped class, and the submit says so.
    assert "note: cli-run already exists with priority high, not normal; `gpusched bump" in said.err
    assert main(["cancel", "cli-run", *d]) == 0
    # The same submit again, for a job held back after two exits 75 in a row: not "placed".
    held = ["submit", "--team", "vision", "--gpus", "1", "--job-id", "cli-3", *d, "--", "sh", "-c", "exit 75"]
    assert main(held) == 0
    s.until(lambda: "held back after 2 infrastructure failures" in (s.status("cli-3").pending_reason or ""))
    capsys.readouterr()
    assert main(held) == 0
    assert capsys.readouterr().out.startswith("cli-3: queued, held back after infrastructure failures in a row, on c1; "
                                              "estimated start ")
    assert main(["cancel", "cli-3", *d]) == 0
    # A cluster's knobs: each set keeps the others; a knob no policy could take, or no cluster, exit 2.
    assert main(["cluster", "set", "c1", "--policy", "grace_period=45", *d]) == 0
    assert main(["cluster", "set", "c1", "--policy", "min_runtime=30", *d]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("c1: ") and json.loads(last[4:]) == {"retry_backoff": 600, "grace_period": 45, "min_runtime": 30}
    assert main(["cluster", "set", "c9", "--policy", "min_runtime=30", *d]) == 2
    assert "unknown cluster 'c9' (known: c1)" in capsys.readouterr().err
    # `gpusched list | head`: a reader gone is not a database that did not answer.
    read, write = os.pipe()
    os.close(read)
    try:
        done = subprocess.run([sys.executable, "-m", "workers.cli", "list", *d], stdout=write,
                              stderr=subprocess.PIPE, text=True, timeout=60)
    finally:
        os.close(write)
    assert (done.returncode, done.stderr) == (1, "")


def listing_raises(monkeypatch, error: Exception) -> None:
    """The CLI's client connects to nothing, and its store's job listing raises `error`."""
    async def list_jobs(**kw):
        raise error

    async def connect(cls, settings=None):
        return GpuschedClient(settings=settings, temporal=None, store=SimpleNamespace(list_jobs=list_jobs))

    async def close(self):
        pass

    monkeypatch.setattr(GpuschedClient, "connect", classmethod(connect))
    monkeypatch.setattr(GpuschedClient, "close", close)
    monkeypatch.setenv("GPUSCHED_PG_DSN", "postgresql://x@127.0.0.1:1/x")


@pytest.mark.parametrize("error", [
    asyncpg.AdminShutdownError("terminating connection due to administrator command"),
    asyncpg.CannotConnectNowError("the database system is starting up"),
    asyncpg.InternalClientError("cannot switch to state 12; another operation (2) is in progress"),
], ids=["shutting down", "starting up", "a pooled connection the shutdown left broken"])
def test_a_database_restarting_under_a_command_is_said_in_one_line_not_a_traceback(monkeypatch, capsys, tmp_path,
                                                                                    error):
    """What the API answers 503 for. Before, these three went out as tracebacks."""
    listing_raises(monkeypatch, error)
    assert main(["list", "--data-dir", str(tmp_path)]) == 1
    assert capsys.readouterr().err.startswith(f"error: the database did not answer ({error});")


def test_a_value_too_long_for_the_database_s_index_is_refused_with_exit_2_not_a_traceback(monkeypatch, capsys, tmp_path):
    """Postgres refuses an index entry over 2,704 bytes; the CLI took only its other value errors."""
    listing_raises(monkeypatch, asyncpg.ProgramLimitExceededError("index row size 3016 exceeds btree version 4 "
                                                                  "maximum 2704"))
    assert main(["list", "--data-dir", str(tmp_path)]) == 2
    assert capsys.readouterr().err.startswith("error: the database cannot store a value of this request (index row")


@pytest.mark.parametrize("error", [RPCError("unavailable", RPCStatusCode.UNAVAILABLE, b""),
                                   asyncpg.CannotConnectNowError("the database system is starting up")],
                         ids=["Temporal gone", "the database restarting"])
def test_a_submit_cut_short_names_the_job_id_it_made_so_that_sending_it_again_is_not_a_second_job(
        monkeypatch, capsys, tmp_path, error):
    """The workflow may have started before the error (the submit waits up to 30 s for the
    admission). Before, the id made for it was never shown: the same command again made a second job."""
    sent = []

    async def submit(self, request):
        sent.append(request.job_id)
        raise error

    async def connect(cls, settings=None):
        return GpuschedClient(settings=settings, temporal=None, store=None)

    async def close(self):
        pass

    monkeypatch.setattr(GpuschedClient, "connect", classmethod(connect))
    monkeypatch.setattr(GpuschedClient, "close", close)
    monkeypatch.setattr(GpuschedClient, "submit", submit)
    monkeypatch.setenv("GPUSCHED_PG_DSN", "postgresql://x@127.0.0.1:1/x")
    assert main(["submit", "--team", "vision", "--gpus", "1", "--data-dir", str(tmp_path), "--", "true"]) == 1
    [job_id] = sent
    assert f"give --job-id {job_id} (the same submit under its id is that job" in capsys.readouterr().err


class CancelledHandle:
    """A job workflow's handle: takes the cancel signal, answers (or fails) the question whether
    a cancellation asked of Temporal is the job's cancel, and records such a cancellation."""

    def __init__(self, answer):
        self.answer, self.signals, self.cancelled = answer, [], False

    async def signal(self, name, reason):
        self.signals.append((name, reason))

    async def query(self, name, result_type=None):
        assert name == "cancels_gracefully"
        if isinstance(self.answer, BaseException):
            raise self.answer
        if self.answer == "never":
            await asyncio.sleep(3600)
        return self.answer

    async def cancel(self):
        self.cancelled = True


@pytest.mark.parametrize("name, answer, asked_of_temporal", [
    ("a workflow that takes a Temporal cancellation as the job's cancel is asked one too", True, True),
    ("one begun before that (it would be cut short) is only signalled", False, False),
    ("a worker that does not know the question: only signalled",
     WorkflowQueryFailedError("unknown queryType cancels_gracefully"), False),
    ("no worker answers in time: only signalled", "never", False),
    ("the workflow ended meanwhile: only signalled", RPCError("gone", RPCStatusCode.NOT_FOUND, b""), False),
])
def test_gpusched_cancel_signals_the_reason_and_asks_temporal_only_a_workflow_that_ends_gracefully(
        monkeypatch, name, answer, asked_of_temporal):
    handle = CancelledHandle(answer)
    store = SimpleNamespace(job_view=lambda job_id: _running(job_id))
    client = GpuschedClient(settings=SimpleNamespace(), temporal=None, store=store)
    monkeypatch.setattr(client, "_handle", lambda job_id: handle)
    monkeypatch.setattr(GpuschedClient, "MARK_WAIT", 0.05)
    view = asyncio.run(client.cancel("j", "not needed"))
    assert view.state == "running" and handle.signals == [("cancel", "not needed")]
    assert handle.cancelled is asked_of_temporal


async def _running(job_id):
    return SimpleNamespace(job_id=job_id, state="running")


class RefusedHandle:
    """The workflow of a job refused at its admission: ended, failed with the job's reason."""

    def __init__(self, reason: str):
        self.reason = reason

    async def describe(self):
        return SimpleNamespace(status=WorkflowExecutionStatus.FAILED)

    async def result(self):
        raise WorkflowFailureError(cause=ApplicationError(self.reason, type=JOB_FAILED))


@pytest.mark.parametrize("ask", ["status", "wait", "cancel"])
def test_a_job_refused_at_its_admission_after_its_submit_answered_is_said_to_be_refused_not_unknown(monkeypatch, ask):
    """A submit not admitted in time answers that the job will be; the admission may then refuse
    it (the team's queue cap reached meanwhile). Before, status, wait and cancel said "no job"."""
    async def nothing(job_id):
        return None

    reason = "team vision has 2 jobs waiting, its queue cap"
    client = GpuschedClient(settings=SimpleNamespace(), temporal=None,
                            store=SimpleNamespace(job_view=nothing, request_of=nothing))
    monkeypatch.setattr(client, "_handle", lambda job_id: RefusedHandle(reason))
    with pytest.raises(ClientError) as refused:
        asyncio.run(getattr(client, ask)("j"))
    assert str(refused.value) == f"job j was refused at its admission: {reason}; nothing of it ran"


class BumpedHandle:
    """A job workflow's handle whose change of class fails as Temporal fails it."""

    def __init__(self, cause: BaseException):
        self.cause = cause

    async def execute_update(self, name, arg, result_type=None):
        raise WorkflowUpdateFailedError(self.cause)


@pytest.mark.parametrize("states, cause, words", [
    (["queued", "queued"], ApplicationError("the job has not been admitted yet"),
     "cannot change the priority of j: the job has not been admitted yet"),
    (["running", "cancelled"], ApplicationError("Workflow Update failed because the Workflow completed before the "
                                                "Update completed."),
     "cannot change the priority of j: it ended (cancelled) before the change was made"),
    (["running", "succeeded"], ApplicationError("the job is already succeeded"),
     "cannot change the priority of j: it ended (succeeded) before the change was made"),
], ids=["not admitted yet: the validator's words", "ended while the change was being made: said in ours",
        "ended between the look and the change"])
def test_gpusched_bump_refused_by_the_workflow_says_why(monkeypatch, states, cause, words):
    seen = iter(states)

    async def job_view(job_id):
        return SimpleNamespace(job_id=job_id, state=next(seen))

    client = GpuschedClient(settings=SimpleNamespace(), temporal=None, store=SimpleNamespace(job_view=job_view))
    monkeypatch.setattr(client, "_handle", lambda job_id: BumpedHandle(cause))
    with pytest.raises(ClientError) as refused:
        asyncio.run(client.bump("j", Priority.high))
    assert str(refused.value) == words


@pytest.mark.parametrize("flags, out", [
    ([], ""),
    (["--json"], "null\n"),
], ids=["a wait that runs out of time for a job not admitted yet exits 124",
        "with --json too, printing null for the job it cannot show (before: exit 1, nothing printed)"])
def test_a_wait_that_runs_out_of_time_exits_124_whether_or_not_the_job_can_be_shown(monkeypatch, capsys, flags, out):
    async def wait(job_id, timeout):
        raise asyncio.TimeoutError

    async def status(job_id):
        raise NotYetAdmitted(f"job {job_id} is not admitted yet")

    client = SimpleNamespace(wait=wait, status=status)
    monkeypatch.setattr("workers.cli_jobs.run_with_client", lambda args, body: asyncio.run(body(client)))
    assert main(["wait", "j", "--timeout", "0.1", *flags]) == 124
    said = capsys.readouterr()
    assert said.out == out and "j had not ended after 0.1 s" in said.err
