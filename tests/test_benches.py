"""The benchmark scripts that need no trace or stack still run and end with their JSON line: a
bench that rots silently (a column the store's rows gained, say) is found here, not by a reader
of docs/results.md."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("script, args, keys", [
    ("cycle.py", ["--cycles", "1"], {"p50_ms", "p99_ms"}),
    ("snapshot_rows.py", ["--cycles", "1"], {"afresh_rows_ms", "reused_rows_ms", "reused_cycle_ms"}),
], ids=["one scheduling cycle at seed scale", "the store's rows turned into a snapshot"])
def test_a_benchmark_runs_and_ends_with_its_figures_as_json(script, args, keys):
    done = subprocess.run([sys.executable, str(ROOT / "bench" / script), *args], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    assert keys <= figures.keys(), figures


def chaos_bench():
    """bench/chaos.py as a module (benches are scripts, not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("chaos_bench", ROOT / "bench" / "chaos.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def life(job: str, gpus: list[str], first: float, last: float) -> dict:
    return {"job": job, "attempt": "1", "gpus": gpus, "first": first, "last": last}


@pytest.mark.parametrize("lives, found", [
    ([life("a", ["m0/0"], 0, 10), life("b", ["m0/0"], 10, 20)], 0),
    ([life("a", ["m0/0"], 0, 10), life("b", ["m0/1"], 5, 20)], 0),
    ([life("a", ["m0/0", "m0/1"], 0, 10), life("b", ["m0/1"], 9.5, 20)], 1),
    ([life("a", ["m0/0"], 0, 30), life("b", ["m0/0"], 5, 6), life("c", ["m0/0"], 20, 40)], 2),
    ([life("a", ["m0/0"], 0, 30), life("b", ["m0/0"], 31, 32), life("c", ["m0/0"], 1, 2)], 1),
], ids=["one after the other on a GPU", "side by side on two GPUs", "one GPU of a gang shared for half a second",
        "a long life overlapping two later ones", "a short one inside a long one, listed last"])
def test_the_chaos_bench_finds_every_pair_of_lives_that_held_one_gpu_at_once(lives, found):
    assert len(chaos_bench().overlaps(lives, "first", "last")) == found


@pytest.mark.parametrize("second_from, found", [
    (9.997, 0), (9.98, 0), (9.9, 1),
], ids=["a start 3 ms before the last end, within the stamps' resolution, is none",
        "nor one 20 ms before it", "one 100 ms before it is"])
def test_the_chaos_bench_takes_ends_closer_than_the_stamps_resolution_for_touching(second_from, found):
    lives = [life("a", ["m0/0"], 0, 10), life("a", ["m0/0"], second_from, 20)]
    assert len(chaos_bench().overlaps(lives, "first", "last", within=0.02)) == found


def test_the_chaos_bench_freezes_a_process_with_every_process_under_it():
    shell = subprocess.Popen(["sh", "-c", "sleep 30 & sleep 30 & wait"], start_new_session=True)
    try:
        deadline = time.monotonic() + 5
        while len(tree := chaos_bench().process_tree(shell.pid)) < 3 and time.monotonic() < deadline:
            time.sleep(0.02)  # the children are being started
        assert tree[0] == shell.pid and len(tree) == 3
        assert all(Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"sleep") for pid in tree[1:])
    finally:
        os.killpg(shell.pid, signal.SIGKILL)  # the sleeps too
        shell.wait()


def chaos_jobs(count: int) -> list:
    """The chaos bench's own workload, as it submits it (seed 1)."""
    import random

    return chaos_bench().workload(random.Random(1), count, 150.0, Path("/nonexistent"))


def test_the_chaos_users_cancel_some_jobs_and_change_the_class_of_others_each_time_to_another_class():
    bench = chaos_bench()
    jobs = chaos_jobs(30)
    users = bench.Users(4, jobs, cancels=5, bumps=7)
    cancelled = [j for j, plan in users.plans.items() if plan[0][1] == "cancel"]
    bumped = {j: plan for j, plan in users.plans.items() if plan[0][1] != "cancel"}
    assert len(cancelled) == 5 and len(bumped) == 7
    submitted = {r.job_id: (at, r.priority) for at, r in jobs}
    for job_id, plan in users.plans.items():
        assert all(submitted[job_id][0] + 5 <= at for at, _ in plan), "not before the job is submitted"
    for job_id, plan in bumped.items():
        classes = [submitted[job_id][1], *(action for _, action in plan)]
        assert all(a != b for a, b in zip(classes, classes[1:])), f"{job_id}: a change to the class it has"
    assert bench.Users(4, jobs, cancels=5, bumps=7).plans == users.plans, "the same seed, the same requests"


def ended(state: str, reason: str | None = None, priority: str = "low", at: float = 100.0) -> dict:
    return {"state": state, "reason": reason, "priority": priority, "updated_at": at}


@pytest.mark.parametrize("cancelled, classes, rows, ignored, lost", [
    ({"a": 95.0}, {}, {"a": ended("cancelled", "chaos: cancelled by its user")}, [], []),
    ({"a": 95.0}, {}, {"a": ended("succeeded")}, [], []),
    ({"a": 60.0}, {}, {"a": ended("succeeded")}, ["a"], []),
    ({"a": 60.0}, {}, {"a": ended("failed", "five infrastructure failures")}, ["a"], []),
    ({"a": 99.0}, {}, {"a": ended("cancelled", "cancelled by request")}, ["a"], []),
    ({}, {"b": "high"}, {"b": ended("succeeded", priority="high")}, [], []),
    ({}, {"b": "high"}, {"b": ended("succeeded", priority="normal")}, [], ["b"]),
], ids=["cancelled with the user's reason", "ended on its own as the cancel was sent",
        "ran on 40 s after its cancel was taken", "failed long after its cancel was taken",
        "cancelled with another reason", "has the class of its last change", "lost its last change of class"])
def test_the_chaos_audit_finds_every_cancel_ignored_and_every_change_of_class_lost(cancelled, classes, rows,
                                                                                     ignored, lost):
    users = chaos_bench().Users(1, [], cancels=0, bumps=0)
    users.cancelled, users.classes = cancelled, classes
    found = users.audit(rows)
    assert sorted(found["cancels_ignored"]) == ignored
    assert sorted(found["class_changes_lost"]) == lost


def test_the_chaos_audit_takes_a_user_request_refused_while_its_job_ran_for_lost_not_too_late():
    users = chaos_bench().Users(1, [], cancels=0, bumps=0)
    users.too_late = {"ended-first": "cancel", "ran-on": "high"}
    users.first_sent = {"ended-first": 101.0, "ran-on": 40.0}  # epoch seconds
    found = users.audit({"ended-first": ended("succeeded", at=100.0), "ran-on": ended("succeeded", at=100.0)})
    assert sorted(found["user_requests_refused_while_running"]) == ["ran-on"]


FIVE_LOST = ["machine_failure", "not_started", "machine_failure", "machine_failure", "machine_failure"]


@pytest.mark.parametrize("row, ends, expected", [
    (ended("cancelled", "chaos: cancelled by its user"), ["preempted"], True),
    (ended("cancelled", "cancelled by request"), ["preempted"], False),
    (ended("cancelled", "chaos: cancelled by its user"), [], True),
    (ended("failed", "machine gone (5 infrastructure failures)"), ["completed"] + FIVE_LOST, True),
    (ended("failed", "machine gone (5 infrastructure failures)"), FIVE_LOST[:4] + ["preempted"], False),
    (ended("failed", "exit code 3"), FIVE_LOST, False),
], ids=["cancelled by its user", "cancelled by someone else", "cancelled by its user before it ever ran", "failed by the limit its attempts bear out",
        "said to be failed by the limit, its attempts say otherwise", "failed for another reason"])
def test_the_chaos_audit_allows_only_the_ends_the_run_explains(row, ends, expected):
    bench = chaos_bench()
    users = bench.Users(1, [], cancels=0, bumps=0)
    users.plans = {"a": [(10.0, "cancel")]}  # taken or not: an outage may have lost its answer
    assert bench.expected_end({**row, "id": "a"}, ends, users) is expected


def test_the_chaos_audit_takes_a_gang_finished_on_one_of_its_machines_for_no_success(tmp_path):
    bench = chaos_bench()
    done = f"done, steps=3 final_state={bench.final_state(3).hex()}\n"
    for machine, text in (("m0", done), ("m1", "step 2/3\n")):
        (tmp_path / "jobs" / machine / "g").mkdir(parents=True)
        (tmp_path / "jobs" / machine / "g" / "attempt-2.log").write_text(text)
    assert bench.final_states(tmp_path, "g", 3, attempt=2, machines=1) is None
    assert "on 1 of its 2 machines" in bench.final_states(tmp_path, "g", 3, attempt=2, machines=2)
    assert "no log of its attempt 3" in bench.final_states(tmp_path, "g", 3, attempt=3, machines=1)


def test_the_chaos_audit_ends_a_process_s_life_when_its_agent_reaped_it_if_before_a_stamp_s_interval(tmp_path):
    """SIGKILLed between two stamps, a process lived at most a stamp's interval past its last;
    its agent's log says when it had surely gone, which may be sooner."""
    bench = chaos_bench()
    stamps, logs = tmp_path / "stamps", tmp_path / "logs"
    stamps.mkdir(), logs.mkdir()
    last = time.mktime(time.strptime("2026-12-06 09:03:33", "%Y-%m-%d %H:%M:%S")) + 0.49
    for allocation, job in ((35, "a"), (36, "b")):
        head = {"job": job, "attempt": "1", "allocation": str(allocation), "machine": "c1/b0/r0/m2",
                "gpus": [f"c1/b0/r0/m2/{allocation - 35}"], "started": last - 10}
        (stamps / f"{job}.1.1").write_text(json.dumps(head) + f"\n{last - 9:.3f}\n{last:.3f}\n")
    (logs / "agent-c1-b0-r0-m2.log").write_text(
        "2026-12-06 09:03:33,560 INFO gpusched.node: allocation 35: job a ended (exit None, signal 9, stopped True)\n"
        "2026-12-06 09:03:35,000 INFO gpusched.node: allocation 36: job b ended (exit 0, signal None, stopped False)\n")
    lives = {life["job"]: life for life in bench.read_stamps(stamps, bench.reaped_at(logs))}
    assert abs(lives["a"]["last"] - (last + 0.07)) < 1e-6  # reaped 0.07 s after its last stamp
    assert abs(lives["b"]["last"] - (last + bench.STAMP_EVERY_S)) < 1e-6  # reaped later than that
    assert lives["a"]["first"] == last - 10  # from its start, before its first stamp
