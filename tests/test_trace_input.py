"""Reading and writing trace CSV: defaults for empty cells, exact round trips, precise errors."""

from __future__ import annotations

import pytest

from scheduler.errors import InputError
from scheduler.models import JobKind, JobSpec, Priority, Topology
from scheduler.sim.trace import COLUMNS, TraceJob, format_trace, parse_trace

HEADER = ",".join(COLUMNS)


def row(**cells) -> str:
    """A CSV row in the contract's column order: a plain 1-GPU job unless cells say otherwise."""
    values = {"job_id": "j1", "submit_time": "0", "duration": "3600", "num_gpus": "1", "team": "vision"}
    values.update(cells)
    return ",".join(str(values.get(c, "")) for c in COLUMNS)


def trace(*rows: str, header: str = HEADER) -> str:
    return "\n".join((header, *rows)) + "\n"


def job(job_id: str = "j1", submit: float = 0.0, duration: float = 3600.0, **spec) -> TraceJob:
    spec.setdefault("team", "vision")
    spec.setdefault("num_gpus", 1)
    spec.setdefault("expected_duration", duration)
    return TraceJob(spec=JobSpec(job_id=job_id, **spec), submit_time=submit, duration=duration)


def test_empty_cells_take_the_documented_defaults():
    [parsed] = parse_trace(trace(row()), "t.csv")
    spec = parsed.spec
    assert (parsed.submit_time, parsed.duration) == (0.0, 3600.0)
    assert spec.priority is Priority.normal and spec.kind is JobKind.training
    assert (
        spec.gpu_type is None
        and spec.topology is None
        and spec.deadline is None
        and spec.cluster is None
    )
    assert spec.checkpoint_interval is None
    assert spec.expected_duration == 3600.0  # no estimate: the true duration


def test_every_column_is_read():
    text = trace(
        row(job_id="big", submit_time="12.5", duration="7200", num_gpus="16", team="language", priority="high",
            gpu_type="H100", topology="block", checkpoint_interval="1800", expected_duration="9000",
            kind="inference", deadline="40000")
    )  # fmt: skip
    [parsed] = parse_trace(text, "t.csv")
    assert parsed == job(
        "big", 12.5, 7200.0, team="language", num_gpus=16, priority=Priority.high, gpu_type="H100",
        topology=Topology.block, checkpoint_interval=1800.0, expected_duration=9000.0,
        kind=JobKind.inference, deadline=40000.0,
    )  # fmt: skip


def test_a_zero_checkpoint_interval_means_never():
    [parsed] = parse_trace(trace(row(checkpoint_interval="0")), "t.csv")
    assert parsed.spec.checkpoint_interval is None and not parsed.spec.checkpoints


def test_extra_columns_are_ignored_but_cluster_and_gpu_memory_are_read():
    header = "owner," + HEADER + ",cluster,gpu_memory_gb,notes"
    [parsed] = parse_trace(trace("alice," + row() + ",c2,141,hello", header=header), "t.csv")
    assert parsed.spec.cluster == "c2" and parsed.spec.gpu_memory_gb == 141.0


def test_only_the_required_columns_need_to_be_present():
    [parsed] = parse_trace("team,num_gpus,job_id,duration,submit_time\nvision,2,a,60,5\n", "t.csv")
    assert parsed == job("a", 5.0, 60.0, num_gpus=2)


def test_jobs_come_back_sorted_by_submit_time_then_id():
    text = trace(
        row(job_id="b", submit_time="10"),
        row(job_id="c", submit_time="5"),
        row(job_id="a", submit_time="10"),
    )
    assert [j.spec.job_id for j in parse_trace(text, "t.csv")] == ["c", "a", "b"]


def test_times_are_kept_to_the_millisecond_as_the_output_files_write_them():
    """A run of finer times wrote allocations.csv and jobs.csv that could not reproduce its
    summary: a 0.0004 s job showed as an empty allocation, and 8 idle gaps as none."""
    (parsed,) = parse_trace(trace(row(submit_time="0.0001", duration="5.0004", expected_duration="7.12351",
                                      checkpoint_interval="1.00049", deadline="9.9996")), "t.csv")
    assert (parsed.submit_time, parsed.duration, parsed.spec.expected_duration, parsed.spec.checkpoint_interval,
            parsed.spec.deadline) == (0.0, 5.0, 7.124, 1.0, 10.0)


def test_a_trace_of_more_jobs_than_any_simulation_takes_stops_at_the_first_one_over(monkeypatch):
    """Every row was kept until the trace was read whole: 2,000,000 rows with a bad last one took
    4 GB before the error (a helper's fuzzing)."""
    from scheduler.sim import trace as trace_module

    monkeypatch.setattr(trace_module, "MOST_TRACE_JOBS", 2)
    with pytest.raises(InputError) as caught:
        parse_trace(trace(row(job_id="a"), row(job_id="b"), row(job_id="c"), row(job_id="d", num_gpus="x")), "t.csv")
    assert caught.value.line == 4 and "a trace holds at most 2 jobs" in str(caught.value)


def test_blank_lines_are_skipped_and_line_numbers_still_count_them():
    with pytest.raises(InputError) as caught:
        parse_trace(trace(row(job_id="a"), "", row(job_id="b", num_gpus="0")), "t.csv")
    assert caught.value.line == 4


ROUND_TRIP_CASES = [
    [job()],
    [job("a", 0.1, 1234.567, expected_duration=1e-3)],
    [
        job(
            "a",
            3.0,
            60.0,
            priority=Priority.critical,
            topology=Topology.any,
            deadline=99.25,
            gpu_type="A100",
        )
    ],
    [
        job("a", cluster="c1"),
        job("b", 1.0, gpu_memory_gb=48.0, checkpoint_interval=600.0, kind=JobKind.inference),
    ],
    [job("x,with comma", 7.0, team='team "quoted"')],
]


@pytest.mark.parametrize(
    "jobs",
    ROUND_TRIP_CASES,
    ids=[
        "a plain job",
        "fractional times to the millisecond survive exactly",
        "every optional field set",
        "cluster and gpu memory columns appear when used",
        "commas and quotes in text are escaped",
    ],
)
def test_format_then_parse_gives_the_same_jobs(jobs):
    assert parse_trace(format_trace(jobs), "t.csv") == jobs


def test_a_plain_trace_is_written_with_exactly_the_contract_columns():
    assert format_trace([job()]).splitlines()[0] == HEADER
    assert format_trace([job(cluster="c1")]).splitlines()[0] == HEADER + ",cluster"


BAD_TRACES = [
    ("", 1, None, "first line must be the header"),
    ("\n" + HEADER + "\n" + row() + "\n", 1, None, "the first line is blank (or the file empty)"),
    (
        "job_id,submit_time,team\na,0,v\n",
        1,
        "duration,num_gpus",
        "lacks required column(s) duration, num_gpus",
    ),
    ("job_id,job_id,submit_time,duration,num_gpus,team\n", 1, "job_id", "appears twice in the header"),
    (trace(), None, None, "no jobs"),
    (trace(row(), row()), 3, "job_id", "already used on line 2"),
    (trace(row(job_id="")), 2, "job_id", "every job needs a job_id"),
    (trace(row(team="")), 2, "team", "every job needs a team"),
    (trace(row(submit_time="-5")), 2, "submit_time", "0 or more, got '-5'"),
    (trace(row(submit_time="soon")), 2, "submit_time", "must be a number"),
    (trace(row(duration="0")), 2, "duration", "above 0, got '0'"),
    (trace(row(duration="nan")), 2, "duration", "above 0, got 'nan'"),
    (trace(row(num_gpus="0")), 2, "num_gpus", "1 or more, got '0'"),
    (trace(row(num_gpus="eight")), 2, "num_gpus", "1 or more, got 'eight'"),
    (trace(row(priority="urgent")), 2, "priority", "one of critical | high | normal | low"),
    (trace(row(topology="rack")), 2, "topology", "one of machine | block | any"),
    (trace(row(kind="batch")), 2, "kind", "one of training | inference"),
    (trace(row(checkpoint_interval="-1")), 2, "checkpoint_interval", "0 or empty for never"),
    (trace(row(expected_duration="0")), 2, "expected_duration", "above 0"),
    (trace(row(deadline="-3600")), 2, "deadline", "0 or more"),
    (trace(row(), "j2,0,60"), 3, None, "one value per column"),
    (trace(row(team='"vision'), row(job_id="b"), row(job_id="c")), 2, "team",
     "opens a quote that is never closed: the rest of the file, to line 4, was read as one value"),
    (trace(row(team='"vision'), row(job_id="b")), 2, "team", "the rest of the file, to line 3"),
    (trace(row(job_id="a"), row(team='"vision')), 3, "team", "the rest of the file, to line 3"),
    (trace(row(team='"vi\nsion"'), row(job_id="b")), 2, "team", "a quoted value runs on to line 3"),
    (trace(row(team='vi"sion'), row(job_id="b", team='"vi\nsion"')), 3, "team", "a quoted value runs on to line 4"),
    (trace(row(checkpoint_interval="1e-300")), 2, "checkpoint_interval", "0 (never) or at least 1 second"),
    (trace(row(duration="1e308")), 2, "duration", "at most 320000000"),
    (trace(row(duration="0.0004")), 2, "duration", "at least 0.001 (times are kept to the millisecond)"),
    (trace(row(submit_time="1e17")), 2, "submit_time", "at most 320000000"),
    (trace(row(duration="1e8", checkpoint_interval="1")), 2, "checkpoint_interval", "give at least 100 s"),
    (trace(row(num_gpus="1_0")), 2, "num_gpus", "1 or more, got '1_0'"),
    (trace(row(num_gpus="\u0663")), 2, "num_gpus", "1 or more"),
    (trace(row(submit_time="1_0")), 2, "submit_time", "must be a number"),
    (trace(row(job_id="j\x003")), 2, "job_id", "control character"),
    (trace(row(gpu_type="H100\x01")), 2, "gpu_type", "control character"),
    ("job_id,submit_time,duration,num_gpus,team\rj1,0,60,1,vision\rj2\r3,0,60,1,vision\n", 3, None,
     "one value per column"),
    (trace(row(team="x" * 200_000)), 2, None, "not valid CSV"),
    (trace(row(team="vision\u202e")), 2, "team", "control character"),
    (trace(row(job_id="j\u20281")), 2, "job_id", "control character"),
    (trace(*(row(job_id=f"j{k}", duration="1e6", checkpoint_interval="1") for k in range(3))), 4,
     "checkpoint_interval", "brings the trace to 3,000,000 checkpoints"),
    (trace(row() + ",1e9", header=HEADER + ",gpu_memory_gb"), 2, "gpu_memory_gb",
     "must be at most 100000 (GB per GPU; no GPU holds more), got '1e9'"),
]


@pytest.mark.parametrize(
    "text, line, field, fix",
    BAD_TRACES,
    ids=[
        "an empty file asks for the header",
        "a blank first line is not called an empty trace",
        "missing required columns are named",
        "a column named twice",
        "a header without rows is an empty trace",
        "a job id used twice points at the first use",
        "an empty job id",
        "an empty team",
        "a negative submit time",
        "a submit time that is not a number",
        "a zero duration",
        "a duration that is not a number at all",
        "a job asking for no GPUs",
        "a GPU count in words",
        "an unknown priority lists the allowed ones",
        "an unknown topology lists the allowed ones",
        "an unknown kind lists the allowed ones",
        "a negative checkpoint interval",
        "a zero estimate",
        "a negative deadline",
        "a short row",
        "an unclosed quote that would swallow the rows after it",
        "an unclosed quote is called one, whichever row it swallows to the end",
        "an unclosed quote on the last row is named there, not as running on to its own line",
        "a quote closed on a later line is a value that runs on",
        "a quote inside an unquoted value does not make a later one that runs on unclosed",
        "a checkpoint interval too short to mean anything",
        "a duration of ages",
        "a duration under half a millisecond",
        "a submit time ages away",
        "a checkpoint interval that would make a million writes",
        "a GPU count with an underscore",
        "a GPU count in another script's digits",
        "a submit time with an underscore",
        "a job id with a control character",
        "a GPU type with a control character",
        "old Mac line endings are line ends, and one inside a value splits its row",
        "a value longer than any CSV reader takes",
        "a team with a right-to-left override",
        "a job id with a line separator",
        "jobs whose checkpoints add up to more than a trace holds, refused at the row that crosses it",
        "a GPU memory past any GPU's, told in GB, not seconds",
    ],
)
def test_a_bad_trace_names_line_column_and_fix(text, line, field, fix):
    with pytest.raises(InputError) as caught:
        parse_trace(text, "t.csv")
    error = caught.value
    assert (error.source, error.line, error.field) == ("t.csv", line, field)
    assert fix in error.message
