"""`gpusched simulate …`: the files docs/metrics.md promises, `--json`, and exit code 2
with one `error:` line for bad input."""

from __future__ import annotations

import csv
import json
import os

import pytest

from workers.cli import main

TRACE = """job_id,submit_time,duration,num_gpus,team,priority,gpu_type,topology,checkpoint_interval,expected_duration,kind,deadline
a,0,3600,8,vision,normal,,,1800,3600,training,
b,60,1200,4,language,high,,,,1500,training,
c,120,900,2,vision,low,,,,600,,
d,300,2400,16,language,critical,,block,600,2400,training,
e,900,600,1,vision,normal,,,,,inference,
"""

FLEET = """clusters:
  - name: c1
    blocks:
      - name: b0
        racks: 1
        machines_per_rack: 2
        gpus_per_machine: 8
        gpu_type: H100
      - name: inf
        racks: 1
        machines_per_rack: 1
        gpus_per_machine: 8
        gpu_type: H100
        partition: inference
quotas:
  vision: {guaranteed: 8, max: 24, queue_cap: 10}
  language: {guaranteed: 8, max: 24}
"""

RUN_FILES = ("allocations.csv", "jobs.csv", "summary.json", "run.png")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def inputs(tmp_path):
    trace, fleet = tmp_path / "trace.csv", tmp_path / "fleet.yaml"
    trace.write_text(TRACE)
    fleet.write_text(FLEET)
    return trace, fleet


def simulate_argv(trace, fleet, out, *more: str) -> list[str]:
    return ["simulate", "--trace", str(trace), "--fleet", str(fleet), "--out", str(out), *more]


def check_run_dir(d, policy: str) -> None:
    for name in RUN_FILES:
        assert (d / name).is_file(), f"{d / name} is missing"
    with open(d / "allocations.csv", newline="") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["job_id", "start", "end", "reason", "gpus"]
    assert (d / "allocations.csv").read_text().splitlines()[0] == "job_id,start,end,reason,gpus"
    body = rows[1:]
    assert {r[0] for r in body} == set("abcde")
    for job_id, start, end, reason, gpus in body:
        assert float(start) <= float(end)
        assert reason in {"completed", "preempted", "failed", "cancelled", "machine_failure"}
        paths = gpus.split(" ")
        assert all(p.startswith("c1/") and p.count("/") == 4 for p in paths), gpus
    assert len(next(r for r in body if r[0] == "d")[4].split(" ")) == 16
    with open(d / "jobs.csv", newline="") as f:
        jobs = list(csv.DictReader(f))
    assert sorted(j["job_id"] for j in jobs) == list("abcde")
    assert all(j["state"] == "completed" for j in jobs)
    summary = json.loads((d / "summary.json").read_text())
    assert summary["policy"] == policy
    assert summary["jobs"]["completed"] == summary["jobs"]["total"] == 5
    assert summary["double_booked_gpus"] == 0
    assert (d / "run.png").read_bytes()[:8] == PNG_MAGIC


def test_simulate_with_compare_writes_every_run_and_a_comparison(tmp_path, inputs, capsys):
    out = tmp_path / "out"
    assert main(simulate_argv(*inputs, out, "--compare", "fifo,easy")) == 0
    check_run_dir(out, "gpusched")
    for policy in ("fifo", "easy"):
        check_run_dir(out / policy, policy)
    table = (out / "comparison.md").read_text()
    assert all(name in table for name in ("gpusched", "fifo", "easy"))
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err


def test_json_prints_the_summary_to_stdout(tmp_path, inputs, capsys):
    out = tmp_path / "out"
    assert main(simulate_argv(*inputs, out, "--policy", "easy", "--compare", "fifo", "--json")) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["policy"] == "easy"
    assert printed == json.loads((out / "summary.json").read_text())
    check_run_dir(out, "easy")
    check_run_dir(out / "fifo", "fifo")


def _bad_num_gpus(d):
    lines = TRACE.splitlines(keepends=True)
    lines[2] = lines[2].replace(",4,language,", ",four,language,")  # line 3 of the file: job b
    (d / "trace.csv").write_text("".join(lines))


def _no_fleet(d):
    (d / "fleet.yaml").unlink()


def _not_utf8(d):
    (d / "trace.csv").write_bytes(TRACE.encode().replace(b"language", b"l\xe9nguage", 1))


def _unknown_cluster(d):
    lines = TRACE.splitlines()
    (d / "trace.csv").write_text("\n".join([lines[0] + ",cluster"] + [line + ",c9" for line in lines[1:]]) + "\n")


def _a_decade_long_job(d):
    (d / "trace.csv").write_text(TRACE + "z,0,320000000,1,vision,low,,,,,,\n")


def _team_without_quota(d):
    (d / "trace.csv").write_text(TRACE.replace("e,900,600,1,vision", "e,900,600,1,audio"))


@pytest.mark.parametrize(
    "spoil, more, expected",
    [
        (_bad_num_gpus, [], ["trace.csv:3", "num_gpus", "'four'"]),
        (_no_fleet, [], ["fleet.yaml", "cannot read the fleet file"]),
        (_team_without_quota, [], ["trace.csv:6", "team", "'audio'", "fleet.yaml"]),
        (_not_utf8, [], ["trace.csv:3", "not UTF-8 text (byte 0xe9)", "save it as UTF-8"]),
        (_unknown_cluster, [], ["trace.csv:2", "cluster", "'c9'", "fleet.yaml does not have"]),
        (lambda d: None, ["--policy", "sjf"], ["unknown policy 'sjf'"]),
        (lambda d: None, ["--compare", "fifo,nope"], ["unknown policy 'nope'"]),
        (lambda d: None, ["--compare", ",,"], ["--compare", "names no policy", "fifo,easy"]),
        (lambda d: None, ["--machine-failures-per-day", "-1"], ["--machine-failures-per-day", "greater than or equal to 0"]),
        (lambda d: None, ["--restart-s", "-30"], ["--restart-s", "greater than or equal to 0"]),
        (lambda d: None, ["--expected-restart-s", "-1"], ["--expected-restart-s", "greater than or equal to 0"]),
        (lambda d: None, ["--until", "-5"], ["--until", "greater than or equal to 0"]),
        (lambda d: None, ["--gpu-failures-per-day", "1e300"], ["--gpu-failures-per-day", "less than or equal to 100"]),
        (_a_decade_long_job, ["--gpu-failures-per-day", "100"],
         ["--gpu-failures-per-day", "3,703.7 days the trace spans", "about 8,888,889 failures", "--until"]),
    ],
    ids=[
        "a malformed trace names its line and field",
        "a missing fleet file",
        "a team without a quota and no '*' default names its line",
        "a trace that is not UTF-8",
        "a cluster the fleet does not have names its line",
        "an unknown policy",
        "an unknown policy to compare with",
        "a comparison of no policy",
        "a negative failure rate",
        "a negative restart time",
        "a negative expected restart time",
        "a stop time before the trace begins",
        "a failure rate that would never let the simulation end",
        "failures over a trace so long that they would take all the host's memory",
    ],
)
def test_bad_input_exits_2_with_one_error_line_and_no_traceback(tmp_path, inputs, capsys, spoil, more, expected):
    spoil(tmp_path)
    out = tmp_path / "out"
    assert main(simulate_argv(*inputs, out, *more)) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("error: ") and captured.err.count("\n") == 1, captured.err
    assert "Traceback" not in captured.err
    for fragment in expected:
        assert fragment in captured.err, f"{fragment!r} not in {captured.err!r}"
    assert not out.exists(), "nothing should be written for bad input"


def test_an_output_folder_that_cannot_be_made_is_refused_before_the_simulation_runs(tmp_path, inputs, capsys):
    (tmp_path / "taken").write_text("a file where the folder should go")
    assert main(simulate_argv(*inputs, tmp_path / "taken" / "out")) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    assert "--out" in err and "give --out a folder you can write" in err, err
    assert "simulated" not in err


def test_an_empty_output_folder_is_refused_not_taken_for_the_current_one(tmp_path, inputs, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(simulate_argv(*inputs, "")) == 2
    err = capsys.readouterr().err
    assert "--out" in err and "is empty" in err and "Traceback" not in err, err
    assert not (tmp_path / "summary.json").exists()


@pytest.mark.parametrize("flag", ["--restart-s", "--machine-failures-per-day", "--until"])
def test_a_number_that_is_not_finite_is_a_usage_error(tmp_path, inputs, capsys, flag):
    with pytest.raises(SystemExit) as exited:
        main(simulate_argv(*inputs, tmp_path / "out", flag, "inf"))
    assert exited.value.code == 2
    assert f"argument {flag}: must be a finite number, not inf" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name, spoil", [
    ("a compared policy's folder is a file", lambda out: (out / "easy").write_text("x")),
    ("a result file is a folder", lambda out: (out / "summary.json").mkdir()),
    ("a result file is a named pipe, which would wait for a reader for ever", lambda out: os.mkfifo(out / "summary.json")),
    ("a result file is a link to nowhere", lambda out: (out / "summary.json").symlink_to(out / "gone" / "x")),
])
def test_an_output_that_cannot_take_every_result_is_refused_before_the_simulation_runs(tmp_path, inputs, capsys,
                                                                                       name, spoil):
    out = tmp_path / "out"
    out.mkdir()
    spoil(out)
    assert main(simulate_argv(*inputs, out, "--compare", "easy")) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "give --out a folder you can write" in err and "simulated" not in err, name


@pytest.mark.parametrize("trace_name, fleet_name, compare, words", [
    ("jobs.csv", "fleet.yaml", [], "out/jobs.csv: field '--out': is the --trace file"),
    ("trace.csv", "summary.json", ["--compare", "easy"], "out/summary.json: field '--out': is the --fleet file"),
    ("allocations.csv", "fleet.yaml", ["--compare", "fifo"], "out/fifo/allocations.csv: field '--out': is the --trace"),
], ids=["the trace is the jobs table's file", "the fleet is the summary's file",
        "the trace is a compared policy's allocations file"])
def test_results_that_would_overwrite_an_input_are_refused_before_the_simulation_runs(tmp_path, capsys, trace_name,
                                                                                      fleet_name, compare, words):
    out = tmp_path / "out"
    (out / "fifo").mkdir(parents=True)
    trace = (out / "fifo" if "fifo" in compare else out) / trace_name
    fleet = (out if fleet_name == "summary.json" else tmp_path) / fleet_name
    trace.write_text(TRACE)
    fleet.write_text(FLEET)
    assert main(simulate_argv(trace, fleet, out, *compare)) == 2
    err = capsys.readouterr().err
    assert words in err and "simulated" not in err, err
    assert trace.read_text() == TRACE and fleet.read_text() == FLEET


@pytest.mark.parametrize("name, spoil", [
    ("the disk is full", lambda out: (out / "summary.json").symlink_to("/dev/full")),
    ("a result file is a dangling link", lambda out: (out / "allocations.csv").symlink_to(out / "gone" / "x.csv")),
])
def test_results_that_cannot_be_written_after_the_run_are_one_line_not_a_traceback(tmp_path, inputs, capsys,
                                                                                   name, spoil):
    out = tmp_path / "out"
    out.mkdir()
    spoil(out)
    assert main(simulate_argv(*inputs, out)) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "cannot write the results here" in err and "Traceback" not in err, name


def test_a_policy_name_is_read_as_compare_reads_them_spaces_and_all(tmp_path, inputs, capsys):
    assert main(simulate_argv(*inputs, tmp_path / "out", "--policy", " fifo ", "--compare", " easy ")) == 0
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["policy"] == "fifo"


def test_guarantees_past_the_clusters_gpus_are_a_warning_and_the_run_goes_on(tmp_path, inputs, capsys):
    trace, fleet = inputs
    fleet.write_text(FLEET.replace("vision: {guaranteed: 8,", "vision: {guaranteed: 24,"))
    out = tmp_path / "out"
    assert main(simulate_argv(trace, fleet, out, "--json")) == 0
    err = capsys.readouterr().err
    assert err.startswith(f"warning: {fleet}: cluster c1 has 24 GPUs (8 of them in the inference partition, "
                          "for inference jobs only), but the teams' guarantees add up to 32 (vision 24, language 8)")
    assert "Traceback" not in err
    check_run_dir(out, "gpusched")


def test_failures_are_drawn_only_up_to_until(tmp_path, inputs, capsys):
    """All of a run's failures are drawn at its start: over a decade-long trace, `--until 1000`
    drew them for the decade all the same (a MemoryError, or a run killed for its memory)."""
    _a_decade_long_job(tmp_path)
    assert main(simulate_argv(*inputs, tmp_path / "out", "--gpu-failures-per-day", "100", "--until", "1000")) == 0
    assert "Traceback" not in capsys.readouterr().err
