"""The bundled example job, run as a process the way an agent runs it, with local ``file://``
checkpoints: it finishes, it checkpoints and exits 0 on SIGTERM within the grace period, a resumed
run continues from its checkpoint and ends in the state of an uninterrupted run, and
``--fail-at-step`` exits 3."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from jobkit import EXIT_STOPPED
from workers.example_job import decode, encode, final_state

ROOT = Path(__file__).resolve().parents[1]


def job_env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUSCHED_")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def start(args: list[str], env: dict, backend: str = "python") -> tuple[subprocess.Popen, "queue.Queue[str]"]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "workers.example_job", "--backend", backend, *args],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    lines: "queue.Queue[str]" = queue.Queue()

    def pump() -> None:
        for line in proc.stdout:
            lines.put(line.rstrip("\n"))
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    return proc, lines


def run_to_end(args: list[str], env: dict, timeout: float = 10) -> tuple[int, list[str]]:
    proc, lines = start(args, env)
    out = []
    deadline = time.monotonic() + timeout
    while (line := lines.get(timeout=max(0.01, deadline - time.monotonic()))) is not None:
        out.append(line)
    return proc.wait(timeout=max(0.01, deadline - time.monotonic())), out


def wait_for(lines: "queue.Queue[str]", prefix: str, out: list[str], timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while True:
        line = lines.get(timeout=max(0.01, deadline - time.monotonic()))
        assert line is not None, f"the job ended before printing {prefix!r}: {out}"
        out.append(line)
        if line.startswith(prefix):
            return


def ack_reports(report_dir: Path, stop: threading.Event) -> None:
    """The agent's part: commit every checkpoint the job reports."""
    while not stop.is_set():
        for report in report_dir.glob("checkpoint-*[0-9].json"):
            ack = report.with_name(report.name.replace(".json", ".ack.json"))
            if not ack.exists():
                ack.write_text(json.dumps({"committed": True, "reason": "ok"}))
        time.sleep(0.01)


def test_a_fresh_run_finishes_with_the_expected_state():
    rc, out = run_to_end(["--steps", "6", "--step-seconds", "0.02"], job_env())
    assert rc == 0, out
    assert out[1] == "example-job: starting at step 0 (fresh)"
    assert [l for l in out if l.startswith("step ")][-1].startswith("step 6/6 state=")
    assert out[-1] == f"example-job: done, steps=6 final_state={final_state(6).hex()}"


@pytest.mark.parametrize("backend", ["python", "idle"])
def test_stopped_with_sigterm_then_resumed_ends_like_an_uninterrupted_run(tmp_path, backend):
    ckdir, reports = tmp_path / "ck", tmp_path / "reports"
    reports.mkdir()
    stop = threading.Event()
    agent = threading.Thread(target=ack_reports, args=(reports, stop), daemon=True)
    agent.start()
    try:
        env = job_env(GPUSCHED_CHECKPOINT_URI=f"file://{ckdir}/", GPUSCHED_REPORT_DIR=str(reports),
                      GPUSCHED_GRACE_PERIOD="5", GPUSCHED_CHECKPOINT_INTERVAL="0.2",
                      GPUSCHED_ALLOCATION_ID="7", GPUSCHED_ATTEMPT="1", GPUSCHED_JOB_ID="ex")
        args = ["--steps", "40", "--step-seconds", "0.05", "--state-mb", "0.25"]
        proc, lines = start(args, env, backend)
        out: list[str] = []
        wait_for(lines, "example-job: checkpoint seq 1 ", out)  # a scheduled one
        wait_for(lines, "step ", out)
        proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        rc = proc.wait(timeout=5)
        took = time.monotonic() - sent
        while (line := lines.get(timeout=5)) is not None:
            out.append(line)
    finally:
        stop.set()
        agent.join()
    assert rc == EXIT_STOPPED and took < 5, out
    assert "committed=True (ok)" in out[[i for i, l in enumerate(out) if "checkpoint seq 1 " in l][0]]
    stopped = out[-1]
    assert stopped.startswith("example-job: stopped at step "), out
    step = int(stopped.split()[4])
    assert 0 < step < 40

    # The last checkpoint holds the step the job stopped at, and was reported as such.
    seq = max(int(p.name) for p in ckdir.iterdir() if p.name.isdigit())
    assert seq >= 2
    report = json.loads((reports / f"checkpoint-{seq:010d}.json").read_text())
    assert report["progress"] == step and report["uri"] == f"file://{ckdir}/{seq:010d}"
    assert report["size"] > 0.25 * 1024 * 1024
    assert decode((ckdir / f"{seq:010d}").read_bytes())[0] == step
    assert json.loads((ckdir / f"{seq:010d}.meta.json").read_text())["allocation-id"] == "7"

    # The control plane resumes it from that checkpoint: the count goes on, the result is the same.
    env2 = job_env(GPUSCHED_CHECKPOINT_URI=f"file://{ckdir}/", GPUSCHED_RESUME_FROM=report["uri"],
                   GPUSCHED_RESUME_SEQ=str(seq), GPUSCHED_ATTEMPT="2")
    rc, out2 = run_to_end(["--steps", "40", "--step-seconds", "0"], env2)
    assert rc == 0, out2
    assert out2[1] == f"example-job: starting at step {step} (resumed from seq {seq})"
    assert out2[2] == (f"step {step + 1}/40 state={final_state(step + 1).hex()[:12]}"
                       f"... (resumed from checkpoint {seq} at step {step})")
    assert out2[-1] == f"example-job: done, steps=40 final_state={final_state(40).hex()}"


def test_the_idle_backend_waits_its_steps_out_without_working():
    """The live tests' jobs: the same state and output, with a step's time waited, not burnt."""
    proc = subprocess.Popen([sys.executable, "-m", "workers.example_job", "--backend", "idle", "--steps", "4",
                             "--step-seconds", "0.5"], cwd=ROOT, env=job_env(), stdout=subprocess.PIPE, text=True)
    began = time.monotonic()
    out = proc.stdout.read().splitlines()
    _, status, usage = os.wait4(proc.pid, 0)
    took = time.monotonic() - began
    assert os.waitstatus_to_exitcode(status) == 0, out
    assert out[0] == "example-job: backend idle (waits out each step)"
    assert out[-1] == f"example-job: done, steps=4 final_state={final_state(4).hex()}"
    # The python backend burns the 2 s it runs; the idle one only starts Python and hashes the state.
    assert took >= 2.0 and usage.ru_utime + usage.ru_stime < 1.0, (took, usage)


def test_a_corrupted_resume_checkpoint_is_refused(tmp_path):
    ckdir = tmp_path / "ck"
    ckdir.mkdir()
    (ckdir / "0000000001").write_bytes(encode(3, 10, final_state(3), 0))
    (ckdir / "0000000001.meta.json").write_text(json.dumps({"sha256": "0" * 64}))
    rc, out = run_to_end(["--steps", "10", "--step-seconds", "0"],
                         job_env(GPUSCHED_RESUME_FROM=f"file://{ckdir}/0000000001"))
    assert rc == 1 and "corrupted" in out[-1], out


def test_a_resume_from_a_checkpoint_store_that_does_not_answer_exits_75_to_be_queued_again():
    """Nothing is wrong with the job nor its checkpoint: it asks to run again later
    (jobkit.EXIT_RETRY_LATER), instead of failing as if its command had."""
    rc, out = run_to_end(["--steps", "10", "--step-seconds", "0"], job_env(
        GPUSCHED_RESUME_FROM="s3://bucket/checkpoints/j/0000000001", GPUSCHED_RESUME_SEQ="1",
        GPUSCHED_S3_ENDPOINT="http://127.0.0.1:9", GPUSCHED_S3_ACCESS_KEY="k", GPUSCHED_S3_SECRET_KEY="s",
        GPUSCHED_S3_RETRY_S="1"), timeout=60)
    assert rc == 75 and "cannot resume" in out[-1], out


def test_fail_at_step_exits_3():
    rc, out = run_to_end(["--steps", "10", "--step-seconds", "0", "--fail-at-step", "4"], job_env())
    assert rc == 3, out
    assert [l for l in out if l.startswith("step ")][-1].startswith("step 3/10 ")


def test_sigterm_without_checkpoints_still_stops_cleanly():
    proc, lines = start(["--steps", "1000", "--step-seconds", "0.05"], job_env(GPUSCHED_GRACE_PERIOD="5"))
    out: list[str] = []
    wait_for(lines, "step 2/", out)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=5) == EXIT_STOPPED
    while (line := lines.get(timeout=5)) is not None:
        out.append(line)
    assert out[-1].startswith("example-job: stopped at step ") and "without a checkpoint" in out[-1], out


def test_on_a_gangs_other_machines_the_job_runs_on_and_leaves_saving_to_rank_0(tmp_path):
    ckdir = tmp_path / "ck"
    env = job_env(GPUSCHED_CHECKPOINT_URI=f"file://{ckdir}/", GPUSCHED_CHECKPOINT_INTERVAL="0.05",
                  GPUSCHED_NODE_RANK="1", GPUSCHED_NUM_NODES="2")
    rc, out = run_to_end(["--steps", "8", "--step-seconds", "0.03"], env)
    assert rc == 0 and out[-1] == f"example-job: done, steps=8 final_state={final_state(8).hex()}", out
    assert any(line.endswith("(scheduled): rank 1, rank 0 saves") for line in out), out
    assert not ckdir.exists()


@pytest.mark.parametrize("args, env, words", [
    (["--steps", "-1"], {}, "must be a finite number >= 0"),
    (["--steps", "1", "--state-mb", "inf"], {}, "must be a finite number >= 0"),
    (["--steps", "1", "--state-mb", "1e12"], {}, "must be at most 16384"),
    (["--steps", "1"], {"GPUSCHED_S3_PART_MB": "²"}, "must be a whole number >= 5"),
    (["--steps", "1", "--step-seconds", "nan"], {}, "must be a finite number >= 0"),
    (["--steps", "1"], {"GPUSCHED_CHECKPOINT_INTERVAL": "abc"}, "is not a number of seconds"),
    (["--steps", "1"], {"GPUSCHED_CHECKPOINT_URI": "bogus"}, "only s3:// and file:// are supported"),
    (["--steps", "1", "--fail-at-step", "0"], {}, "must be a finite number >= 1"),
], ids=["a negative count", "an infinite state", "a state bigger than memory", "a part size in superscript",
        "a step time that is not a number",
        "a checkpoint interval that is not a number", "a checkpoint URI no store has",
        "a failure at a step that never comes (steps count from 1)"])
def test_bad_arguments_exit_2(args, env, words):
    rc, out = run_to_end(args, job_env(**env))
    assert rc == 2 and words in out[-1] and not any("Traceback" in line for line in out), out


@pytest.mark.parametrize("steps", [0, 1])
def test_tiny_runs(steps):
    rc, out = run_to_end(["--steps", str(steps), "--step-seconds", "0"], job_env())
    assert rc == 0 and out[-1].endswith(f"final_state={final_state(steps).hex()}")


def test_the_cli_command_parses_its_arguments():
    import argparse

    from workers.example_job import add_example_job_command, run

    parser = argparse.ArgumentParser(prog="gpusched")
    add_example_job_command(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["example-job", "--steps", "5", "--step-seconds", "0.5", "--state-mb", "2",
                              "--fail-at-step", "3"])
    assert (args.steps, args.step_seconds, args.state_mb, args.fail_at_step, args.backend) == (5, 0.5, 2.0, 3, "auto")
    assert args.func is run


@pytest.mark.live
def test_checkpoints_to_s3_and_resumes_from_them(live_servers, tmp_path):
    import uuid

    prefix = f"checkpoints/example-{uuid.uuid4().hex[:8]}"
    s3 = {"GPUSCHED_CHECKPOINT_URI": f"s3://{live_servers.s3_bucket}/{prefix}/",
          "GPUSCHED_S3_ENDPOINT": live_servers.s3_endpoint, "GPUSCHED_S3_REGION": live_servers.s3_region,
          "GPUSCHED_S3_ACCESS_KEY": live_servers.s3_access_key,
          "GPUSCHED_S3_SECRET_KEY": live_servers.s3_secret_key, "GPUSCHED_GRACE_PERIOD": "5"}
    proc, lines = start(["--steps", "100", "--step-seconds", "0.05"], job_env(**s3))
    out: list[str] = []
    wait_for(lines, "step 3/", out)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=5) == EXIT_STOPPED
    while (line := lines.get(timeout=5)) is not None:
        out.append(line)
    assert out[-2].startswith("example-job: checkpoint seq 1 at step "), out
    step = int(out[-1].split()[4])
    body = live_servers.s3_client().get_object(Bucket=live_servers.s3_bucket, Key=f"{prefix}/0000000001")
    assert decode(body["Body"].read())[0] == step

    rc, out2 = run_to_end(["--steps", "10", "--step-seconds", "0"], job_env(
        **s3, GPUSCHED_RESUME_FROM=f"s3://{live_servers.s3_bucket}/{prefix}/0000000001", GPUSCHED_RESUME_SEQ="1"))
    assert rc == 0 and out2[1] == f"example-job: starting at step {step} (resumed from seq 1)", out2
    assert out2[-1] == f"example-job: done, steps=10 final_state={final_state(10).hex()}"
