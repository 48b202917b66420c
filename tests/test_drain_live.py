"""Cordon and drain on the real stack (`gpusched fleet cordon | drain | uncordon | list`): a
drained machine's job checkpoints and resumes elsewhere, counted as no preemption; a cordoned
machine's job runs on; nothing new goes to either until the machine is back in service."""

from __future__ import annotations

import json
import re

import pytest

from live.jobs import example_job, sleeper
from workers.cli import main

pytestmark = pytest.mark.live


def machine_of(gpu_path: str) -> str:
    return gpu_path.rsplit("/", 1)[0]


def listed(s, capsys) -> dict[str, str]:
    """`gpusched fleet list`: each machine's line."""
    assert main(["fleet", "list", "--data-dir", str(s.data_dir)]) == 0
    return {line.split()[0]: line for line in capsys.readouterr().out.splitlines()}


def test_a_drained_machine_s_job_moves_with_a_checkpoint_and_the_machine_takes_work_again_once_back(stack, capsys):
    s = stack(machines=2, gpus=4, policy={"min_runtime": 0, "grace_period": 10})
    d = ["--data-dir", str(s.data_dir)]
    s.submit("mover", 4, example_job(steps=120, step_seconds=0.2), topology="machine", checkpoint_interval=60)
    s.until(lambda: re.search(r"^step 3/120", s.log("mover"), re.M))
    drained = machine_of(s.status("mover").attempts[0].gpus[0])
    other = next(m for m in listed(s, capsys) if m != drained)

    assert main(["fleet", "drain", drained, "--reason", "PSU swap", *d]) == 0
    out = capsys.readouterr().out
    assert f"{drained}: draining (PSU swap): nothing new is placed there, and its 1 job(s)" in out

    s.until(lambda: len(s.status("mover").attempts) == 2 and s.status("mover").attempts[1].started_at, timeout=60)
    first, second = s.status("mover").attempts
    assert first.end_reason == "machine_failure"
    ordered = s.sql("SELECT reason FROM audit WHERE job_id = 'mover' AND event = 'preempt_ordered'")
    assert [r["reason"] for r in ordered] == [f"machine {drained} is being drained"]
    assert {machine_of(g) for g in second.gpus} == {other}
    assert second.resumed_from is not None  # it checkpointed in its grace
    assert s.sql("SELECT preemptions FROM jobs WHERE id = 'mover'")[0]["preemptions"] == []  # no thrash count
    s.until(lambda: "drained (PSU swap)" in listed(s, capsys)[drained], timeout=30)
    assert listed(s, capsys)[other].endswith("up; jobs 1: mover")
    assert main(["fleet", "list", "--json", *d]) == 0
    shown = {m["id"]: m for m in json.loads(capsys.readouterr().out)}
    assert (shown[drained]["state"], shown[drained]["jobs"], shown[other]["jobs"]) == ("drained (PSU swap)", [], ["mover"])

    # The other machine is busy and the drained one takes nothing: a second whole-machine job waits.
    s.submit("next", 4, sleeper(0.5), topology="machine")
    s.until(lambda: s.status("next").reason, timeout=30)
    assert s.status("next").state == "queued" and not s.status("next").attempts

    assert main(["fleet", "uncordon", drained, *d]) == 0
    assert f"{drained}: back in service" in capsys.readouterr().out
    nxt = s.wait("next", timeout=60)
    assert nxt.state == "succeeded" and {machine_of(g) for g in nxt.attempts[0].gpus} == {drained}
    assert listed(s, capsys)[drained].endswith("up; jobs 0")
    assert s.wait("mover", timeout=90).state == "succeeded"


def test_a_cordoned_machine_s_job_runs_on_and_nothing_new_goes_there(stack, capsys):
    s = stack(machines=1, gpus=4, policy={"min_runtime": 0})
    d = ["--data-dir", str(s.data_dir)]
    s.submit("stays", 2, sleeper(4))
    s.until(lambda: s.status("stays").state == "running", timeout=30)
    [machine] = {machine_of(g) for g in s.status("stays").attempts[0].gpus}
    assert main(["fleet", "cordon", machine, *d]) == 0
    assert f"{machine}: cordoned: nothing new is placed there; its 1 job(s) run on" in capsys.readouterr().out
    assert "cordoned" in listed(s, capsys)[machine]

    s.submit("waits", 1, sleeper(0.1))
    stays = s.wait("stays", timeout=60)
    assert stays.state == "succeeded" and len(stays.attempts) == 1
    assert s.status("waits").state == "queued"  # two GPUs were free all along

    assert main(["fleet", "uncordon", machine, *d]) == 0
    assert s.wait("waits", timeout=60).state == "succeeded"


@pytest.mark.parametrize("argv, words", [
    (["fleet", "drain", "c1/b0/r0/m9"], "error: machine_id: no machine c1/b0/r0/m9 in the fleet; `gpusched fleet list`"),
    (["fleet", "cordon", "c1/b0/r0/m0", "--reason", "x" * 201], "error: reason: give a few printable words, at most 200"),
    (["fleet", "uncordon", "/"], "error: machine_id"),
], ids=["an unknown machine is named, with where to find the known ones", "a reason past its length",
        "no machine at all"])
def test_a_cordon_the_fleet_cannot_take_is_refused_with_exit_2_and_changes_nothing(stack, capsys, argv, words):
    s = stack(machines=1, gpus=2)
    assert main([*argv, "--data-dir", str(s.data_dir)]) == 2
    assert words in capsys.readouterr().err
    assert all(line.endswith("up; jobs 0") for line in listed(s, capsys).values())
