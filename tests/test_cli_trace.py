"""`gpusched trace …`: files in, files out, one summary line, and exit code 2 for bad input."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from scheduler.fleet import parse_fleet
from scheduler.sim.trace import parse_trace
from workers.cli_trace import add_trace_commands

PHILLY_HEADER = "timestamp,duration,num_gpus,gpu_time,cluster\n"


def run(*argv: str) -> int:
    """Parse like the real CLI does, then call the chosen handler."""
    parser = argparse.ArgumentParser(prog="gpusched")
    add_trace_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(list(argv))
    return args.func(args)


def test_generate_writes_a_trace_that_parses_and_a_fleet_that_fits_it(tmp_path, capsys):
    out, fleet_out = tmp_path / "t.csv", tmp_path / "f.yaml"
    code = run("trace", "generate", "--out", str(out), "--jobs", "120", "--days", "1", "--gpus", "128",
               "--load", "1.1", "--seed", "4", "--inference-fraction", "0.05", "--fleet-out", str(fleet_out))  # fmt: skip
    assert code == 0
    jobs = parse_trace(out.read_text(), str(out))
    assert len(jobs) == 120 and sum(j.spec.kind.value == "inference" for j in jobs) == 6
    assert parse_fleet(fleet_out.read_text(), str(fleet_out)).total_gpus >= 128
    summary = capsys.readouterr().err.strip()  # standard output may be the trace (--out /dev/stdout)
    assert (
        summary.startswith(f"wrote {out}: 120 jobs over 1 days")
        and "GPU-seconds offered, load" in summary
    )


def test_from_philly_converts_the_window_and_reports_the_load(tmp_path, capsys):
    source = tmp_path / "philly.csv"
    source.write_text(
        PHILLY_HEADER + "2017-10-16 01:00:00,3600.0,8,28800.0,abc\n2017-09-01 00:00:00,60.0,1,60.0,abc\n"
    )
    out, fleet_out = tmp_path / "t.csv", tmp_path / "f.yaml"
    code = run(
        "trace",
        "from-philly",
        "--input",
        str(source),
        "--out",
        str(out),
        "--fleet-out",
        str(fleet_out),
        "--load",
        "0.5",
    )
    assert code == 0
    [job] = parse_trace(out.read_text(), str(out))
    assert (job.spec.job_id, job.spec.team, job.submit_time) == ("philly-2", "vc-abc", 3600.0)
    assert "vc-abc" in parse_fleet(fleet_out.read_text(), str(fleet_out)).quotas
    # The fleet says how to make it again, from the file it was made from.
    assert fleet_out.read_text().startswith(f"# Made by: gpusched trace from-philly --input {source} ")
    assert "1 jobs over 7 days" in capsys.readouterr().err


@pytest.mark.parametrize("cluster", ["😀", "vc·é", "a\"b"], ids=["past U+FFFF", "accents", "a quote"])
def test_from_philly_writes_a_fleet_whose_team_names_read_back_as_written(tmp_path, capsys, cluster):
    """A name past U+FFFF was written as JSON escapes it (a surrogate pair), which YAML reads as
    two lone surrogates: the fleet could not be read back, and was said too big."""
    source = tmp_path / "philly.csv"
    source.write_text(PHILLY_HEADER + f"2017-10-16 02:00:00,3600,4,1,{cluster}\n", encoding="utf-8")
    out, fleet_out = tmp_path / "t.csv", tmp_path / "f.yaml"
    assert run("trace", "from-philly", "--input", str(source), "--out", str(out), "--fleet-out", str(fleet_out)) == 0
    assert f"vc-{cluster}" in parse_fleet(fleet_out.read_text(encoding="utf-8"), str(fleet_out)).quotas
    [job] = parse_trace(out.read_text(encoding="utf-8"), str(out))
    assert job.spec.team == f"vc-{cluster}"


def test_a_fleet_file_that_cannot_be_written_is_named_not_the_trace(tmp_path, capsys):
    """/dev/full opens but refuses the write, with no file name on the error."""
    out = tmp_path / "t.csv"
    assert run("trace", "generate", "--jobs", "10", "--gpus", "8", "--days", "1", "--out", str(out),
               "--fleet-out", "/dev/full") == 2
    err = capsys.readouterr().err
    assert err.startswith("error: /dev/full: ") and "Traceback" not in err, err
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_a_fleet_file_that_cannot_be_written_leaves_the_old_trace_as_it_was(tmp_path, capsys):
    out = tmp_path / "t.csv"
    out.write_text("keep\n")
    assert run("trace", "generate", "--jobs", "10", "--gpus", "8", "--days", "1", "--out", str(out),
               "--fleet-out", "/dev/full") == 2
    assert out.read_text() == "keep\n" and list(tmp_path.iterdir()) == [out]


def test_a_trace_written_to_standard_output_is_the_trace_alone(tmp_path):
    made = subprocess.run([sys.executable, "-m", "workers.cli", "trace", "generate", "--jobs", "5", "--days", "1",
                           "--gpus", "16", "--out", "/dev/stdout"], capture_output=True, text=True, check=True)
    assert len(parse_trace(made.stdout, "stdout")) == 5
    assert made.stderr.startswith("wrote /dev/stdout: 5 jobs")


@pytest.mark.parametrize(
    "make_input, argv, expected",
    [
        (
            lambda d: (d / "p.csv").write_text(
                PHILLY_HEADER + "2017-10-16 00:00:00,60.0,1,60.0,a\nyesterday,60.0,1,60.0,a\n"
            ),
            ["from-philly", "--input", "{d}/p.csv"],
            "p.csv:3: field 'timestamp'",
        ),
        (lambda d: None, ["from-philly", "--input", "{d}/missing.csv"], "missing.csv"),
        (
            lambda d: (d / "p.csv").write_text(PHILLY_HEADER + "2017-01-01 00:00:00,60.0,1,60.0,a\n"),
            ["from-philly", "--input", "{d}/p.csv"],
            "no jobs in the 7.0-day window",
        ),
        (lambda d: None, ["generate", "--jobs", "0"], "field 'jobs': must be between 1 and 1,000,000"),
        (lambda d: None, ["generate", "--gpus", "1" + "0" * 400], "field 'gpus': must be between 1 and 10,000,000"),
        (
            lambda d: (d / "p.csv").write_text(PHILLY_HEADER + "2017-10-16 00:00:00,60.0,1,60.0," + "x" * 200_000 + "\n"),
            ["from-philly", "--input", "{d}/p.csv"],
            "is not valid CSV",
        ),
        (
            lambda d: (d / "p.csv").write_text(PHILLY_HEADER + '2017-10-16 00:00:00,60.0,1,60.0,"a\nb"\n'),
            ["from-philly", "--input", "{d}/p.csv"],
            "p.csv:2: a quoted value runs on to line 3",
        ),
        (
            lambda d: (d / "p.csv").write_text(PHILLY_HEADER + "2017-10-16 00:00:00,60.0,1,60.0,a\n"),
            ["from-philly", "--input", "{d}/p.csv", "--fleet-out", "{d}/f.yaml", "--load", "1e-300"],
            "--load: must be between 0.01 and 100",
        ),
    ],
    ids=[
        "a malformed Philly row names its line",
        "a missing input file",
        "a window without jobs",
        "an impossible generator argument",
        "a generator fleet of more GPUs than any",
        "a Philly cell longer than any CSV reader takes",
        "a Philly value that runs on to the next line",
        "a load no fleet can be sized for",
    ],
)
def test_bad_input_exits_2_with_one_line_and_no_traceback(tmp_path, capsys, make_input, argv, expected):
    make_input(tmp_path)
    argv = [a.format(d=tmp_path) for a in argv]
    assert run("trace", *argv, "--out", str(tmp_path / "t.csv")) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("error: ") and expected in captured.err
    assert "Traceback" not in captured.err and captured.err.count("\n") == 1
    assert not (tmp_path / "t.csv").exists()


def test_an_unwritable_output_exits_2(tmp_path, capsys):
    assert (
        run(
            "trace",
            "generate",
            "--jobs",
            "10",
            "--gpus",
            "8",
            "--days",
            "1",
            "--out",
            str(tmp_path / "no" / "t.csv"),
        )
        == 2
    )
    assert capsys.readouterr().err.startswith("error: ")


@pytest.mark.parametrize("argv, words", [
    (["from-philly", "--input", "{d}/same.csv", "--out", "{d}/same.csv"], "--out: is the input"),
    (["generate", "--jobs", "5", "--out", "{d}/same.csv", "--fleet-out", "{d}/same.csv"], "--fleet-out: is --out"),
    (["from-philly", "--input", "{d}/same.csv", "--out", "{d}/t.csv", "--days", "1", "--start", "2017-10-16 00:00:00",
      "--fleet-out", "{d}/same.csv"], "--fleet-out: is the input"),
    (["from-philly", "--input", "{d}/same.csv", "--out", "{d}/t.csv", "--days", "1e308"], "--days: must be above 0 and at most 3660"),
], ids=["a conversion onto its own input", "a fleet onto the trace", "a fleet onto the input", "a window of more days than any trace"])
def test_a_trace_command_never_overwrites_its_input_nor_writes_two_files_into_one(tmp_path, capsys, argv, words):
    original = PHILLY_HEADER + "2017-10-16 00:00:00,60.0,1,60.0,a\n"
    (tmp_path / "same.csv").write_text(original)
    assert run("trace", *[a.format(d=tmp_path) for a in argv]) == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err
    assert (tmp_path / "same.csv").read_text() == original


def test_an_input_far_bigger_than_any_trace_is_refused_without_reading_it_all(tmp_path, capsys, monkeypatch):
    from workers import arg_types

    monkeypatch.setattr(arg_types, "MAX_INPUT_BYTES", 100)
    (tmp_path / "big.csv").write_text(PHILLY_HEADER + "2017-10-16 00:00:00,60.0,1,60.0,a\n" * 10)
    assert run("trace", "from-philly", "--input", str(tmp_path / "big.csv"), "--out", str(tmp_path / "t.csv")) == 2
    assert "is over 0 MiB; is it the right file?" in capsys.readouterr().err


def test_a_fleet_that_cannot_be_written_leaves_no_trace_behind_and_the_command_is_quoted(tmp_path, capsys):
    out, kept = tmp_path / "t.csv", tmp_path / "old.csv"
    assert run("trace", "generate", "--jobs", "10", "--gpus", "8", "--days", "1", "--out", str(out),
               "--fleet-out", str(tmp_path / "no-such-folder" / "f.yaml")) == 2
    assert not out.exists() and "no-such-folder/f.yaml" in capsys.readouterr().err
    kept.write_text("an old trace\n")  # one already there is neither emptied nor replaced
    assert run("trace", "generate", "--jobs", "10", "--gpus", "8", "--days", "1", "--out", str(kept),
               "--fleet-out", str(tmp_path / "no-such-folder" / "f.yaml")) == 2
    assert kept.read_text() == "an old trace\n"
    assert run("trace", "generate", "--jobs", "10", "--gpus", "8", "--days", "1", "--out", str(kept)) == 0
    assert kept.read_text().startswith("job_id,")
    spaced, fleet = tmp_path / "a trace.csv", tmp_path / "a fleet.yaml"
    assert run("trace", "generate", "--jobs", "10", "--gpus", "8", "--days", "1", "--out", str(spaced),
               "--fleet-out", str(fleet)) == 0
    assert f"--out '{spaced}' --fleet-out '{fleet}'" in fleet.read_text().splitlines()[0]


def test_a_fleet_too_big_to_write_names_the_flags_that_size_it_not_a_file_never_written(tmp_path, capsys):
    out, fleet_out = tmp_path / "t.csv", tmp_path / "f.yaml"
    assert run("trace", "generate", "--gpus", "1000000", "--load", "0.01", "--out", str(out),
               "--fleet-out", str(fleet_out)) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --fleet-out: the fleet this trace needs at this --load is more than") and \
        "give a higher --load" in err and "generated fleet" not in err, err
    assert list(tmp_path.iterdir()) == []


def test_a_philly_window_too_short_for_its_jobs_says_to_lengthen_it(tmp_path, capsys):
    source = tmp_path / "philly.csv"
    source.write_text(PHILLY_HEADER + "2017-10-16 00:00:10,3000000.0,128,384000000.0,abc\n")
    out, fleet_out = tmp_path / "t.csv", tmp_path / "f.yaml"
    assert run("trace", "from-philly", "--input", str(source), "--out", str(out), "--days", "0.0002",
               "--fleet-out", str(fleet_out)) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --fleet-out: the fleet this trace needs at this --load is more than") and \
        "GPUs; a fleet file holds at most 1,000,000" in err and "(a longer --days)" in err, err
    assert not out.exists() and not fleet_out.exists()


@pytest.mark.parametrize("out, words", [
    ("{d}/traces/", "'{d}/traces/' is a folder; give the name of a file"),
    ("{d}", "'{d}' is a folder"),
    ("", "argument --out: is empty; give a file name"),
], ids=["a folder's name with its slash, which would have been written as a file", "a folder that is there",
        "nothing"])
def test_a_trace_is_written_to_a_file_not_to_a_folder_s_name(tmp_path, capsys, out, words):
    with pytest.raises(SystemExit) as exited:
        run("trace", "generate", "--jobs", "5", "--out", out.format(d=tmp_path))
    assert exited.value.code == 2 and words.format(d=tmp_path) in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_a_trace_under_a_file_names_the_file_asked_for_not_a_temporary_one(tmp_path, capsys):
    """It said `error: .../f/.x.csv.<pid>.partial: Not a directory`: cleaning up the temporary
    file raised again, over the error that named the user's path."""
    (tmp_path / "f").write_text("")
    assert run("trace", "generate", "--jobs", "10", "--gpus", "8", "--days", "1", "--out", str(tmp_path / "f" / "x.csv")) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path}/f/x.csv" in err and ".partial" not in err, err


@pytest.mark.parametrize("argv, flags", [
    (["generate", "--jobs", "200", "--days", "1", "--gpus", "64"], "--jobs or --days"),
    (["from-philly", "--input", "{d}/philly.csv"], "--days"),
], ids=["a generated workload", "a Philly window"])
def test_a_trace_of_more_checkpoints_than_simulate_takes_is_not_written(tmp_path, capsys, monkeypatch, argv, flags):
    """It was written (exit 0), and `gpusched simulate` then refused it: 100,000 jobs over 100
    days made 2,000,029 checkpoints against a cap of 2,000,000 (a helper's fuzzing)."""
    from workers import cli_trace

    monkeypatch.setattr(cli_trace, "MOST_CHECKPOINTS_IN_TRACE", 3)
    (tmp_path / "philly.csv").write_text(PHILLY_HEADER + "2017-10-16 00:00:10,36000.0,8,288000.0,abc\n")
    out = tmp_path / "t.csv"
    assert run("trace", *[a.format(d=tmp_path) for a in argv], "--out", str(out)) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {flags}: the trace would hold ") and \
        f"more than the 3 gpusched simulate takes; give a smaller {flags}" in err, err
    assert not out.exists()
