"""Synthetic and converted workloads: deterministic, on target, and the mix they document."""

from __future__ import annotations

from collections import Counter

import pytest

from scheduler.errors import InputError
from scheduler.fleet import parse_fleet
from scheduler.models import JobKind, JobSpec, Priority
from scheduler.sim.trace import TraceJob, format_trace, parse_trace
from scheduler.sim.workloads import (
    DEFAULT_TEAMS,
    MAX_DURATION,
    MIN_DURATION,
    fleet_for,
    from_philly,
    generate_trace,
    offered_gpu_seconds,
    offered_load,
)

DAY = 86400.0


@pytest.fixture(scope="module")
def seed_trace() -> list[TraceJob]:
    return generate_trace()


# --- The generator -----------------------------------------------------------------------------


def test_the_same_seed_gives_the_same_trace():
    small = {"jobs": 200, "days": 1, "gpus": 256}
    assert generate_trace(**small, seed=7) == generate_trace(**small, seed=7)
    assert generate_trace(**small, seed=7) != generate_trace(**small, seed=8)


@pytest.mark.parametrize(
    "arguments",
    [
        {},
        {"jobs": 400, "days": 1, "gpus": 256, "load": 1.1, "inference_fraction": 0.05},
        {"jobs": 1000, "days": 2, "gpus": 1024, "load": 0.6, "seed": 3},
        {"jobs": 50, "days": 0.5, "gpus": 64, "load": 2.0, "seed": 9, "teams": {"solo": 1.0}},
    ],
    ids=["the defaults", "the README quick start", "a light load", "a tiny overloaded cluster"],
)
def test_the_offered_load_is_on_target(arguments):
    jobs = generate_trace(**arguments)
    expected = {"jobs": 3000, "days": 3.0, "gpus": 5120, "load": 1.2} | arguments
    assert len(jobs) == expected["jobs"]
    load = offered_load(jobs, expected["gpus"], expected["days"] * DAY)
    assert load == pytest.approx(expected["load"], rel=0.02)
    assert all(0 <= j.submit_time < expected["days"] * DAY for j in jobs)


def test_jobs_are_numbered_in_submit_order(seed_trace):
    assert [j.spec.job_id for j in seed_trace[:2]] == ["gen-000001", "gen-000002"]
    assert [j.submit_time for j in seed_trace] == sorted(j.submit_time for j in seed_trace)


def test_training_durations_stay_between_ten_minutes_and_three_days(seed_trace):
    durations = [j.duration for j in seed_trace]
    assert min(durations) >= MIN_DURATION == 600 and max(durations) <= MAX_DURATION == 259200


def share(jobs, predicate) -> float:
    return sum(1 for j in jobs if predicate(j)) / len(jobs)


@pytest.mark.parametrize(
    "what, predicate, low, high",
    [
        ("critical", lambda j: j.spec.priority is Priority.critical, 0.02, 0.045),
        ("high", lambda j: j.spec.priority is Priority.high, 0.13, 0.17),
        ("normal", lambda j: j.spec.priority is Priority.normal, 0.49, 0.55),
        ("low", lambda j: j.spec.priority is Priority.low, 0.27, 0.33),
        ("single GPU", lambda j: j.spec.num_gpus == 1, 0.30, 0.38),
        ("multi-machine", lambda j: j.spec.num_gpus > 8, 0.10, 0.15),
        ("deadline", lambda j: j.spec.deadline is not None, 0.08, 0.12),
        ("language", lambda j: j.spec.team == "language", 0.27, 0.33),
    ],
    ids=[
        "about 3% critical",
        "about 15% high",
        "about 52% normal",
        "about 30% low",
        "about a third on one GPU",
        "10 to 15% span machines",
        "about 10% carry a deadline",
        "about 30% from the language team",
    ],
)
def test_the_mix_is_as_documented(seed_trace, what, predicate, low, high):
    assert low <= share(seed_trace, predicate) <= high


def test_long_training_jobs_mostly_checkpoint_and_short_ones_never(seed_trace):
    long_jobs = [j for j in seed_trace if j.duration > 3600]
    assert 0.81 <= share(long_jobs, lambda j: j.spec.checkpoints) <= 0.89
    assert {j.spec.checkpoint_interval for j in long_jobs} == {None, 1800.0, 3600.0}
    assert not any(j.spec.checkpoints for j in seed_trace if j.duration <= 3600)


def test_estimates_are_wrong_both_ways(seed_trace):
    over = share(seed_trace, lambda j: j.spec.expected_duration > 1.2 * j.duration)
    under = share(seed_trace, lambda j: j.spec.expected_duration < j.duration / 1.2)
    assert 0.25 < over < 0.40 and 0.25 < under < 0.40


def test_every_default_team_appears(seed_trace):
    assert {j.spec.team for j in seed_trace} == set(DEFAULT_TEAMS)


def test_inference_jobs_are_short_small_high_priority_and_never_checkpoint():
    jobs = generate_trace(jobs=1000, days=1, gpus=1024, load=1.0, inference_fraction=0.2)
    inference = [j for j in jobs if j.spec.kind is JobKind.inference]
    assert len(inference) == 200
    assert all(j.spec.num_gpus <= 8 and j.spec.priority is Priority.high for j in inference)
    assert all(not j.spec.checkpoints and j.duration <= 4 * 3600 for j in inference)


def test_a_generated_trace_round_trips_through_csv():
    jobs = generate_trace(jobs=300, days=1, gpus=512, inference_fraction=0.1)
    assert parse_trace(format_trace(jobs), "gen.csv") == jobs


@pytest.mark.parametrize(
    "arguments, field",
    [
        ({"jobs": 0}, "jobs"),
        ({"load": 0}, "load"),
        ({"inference_fraction": 1.5}, "inference_fraction"),
        ({"inference_fraction": 1.0}, "inference_fraction"),
        ({"jobs": 10, "gpus": 5120, "load": 50.0}, "load"),
    ],
    ids=["no jobs", "no load", "a fraction above one", "only inference jobs, which leave none to carry the load",
         "more work than ten 3-day jobs can carry"],
)
def test_impossible_generator_arguments_are_input_errors(arguments, field):
    with pytest.raises(InputError) as caught:
        generate_trace(**arguments)
    assert caught.value.field == field
    if field == "inference_fraction":
        assert "must be 0 or more and below 1" in caught.value.message


# --- The Philly converter ----------------------------------------------------------------------

FAKE_PHILLY = """\
timestamp,duration,num_gpus,gpu_time,cluster
2017-10-16 00:00:00,100.0,1,100.0,aaa111
2017-10-15 23:59:59,50.0,1,50.0,aaa111
2017-10-17 12:00:00,999999.0,8,7999992.0,bbb222
2017-10-16 06:00:00,0.0,1,0.0,aaa111
2017-10-23 00:00:00,60.0,2,120.0,bbb222
2017-10-22 23:59:59,0.4,1,0.4,ccc333
2017-10-16 06:00:00,7200.0,4,28800.0,bbb222

"""


def test_philly_rows_in_the_window_become_jobs_named_by_their_line():
    jobs = from_philly(FAKE_PHILLY, "philly.csv")
    by_id = {j.spec.job_id: j for j in jobs}
    # line 3 is before the window, line 5 ran for 0 s, line 6 is at the window's end
    assert list(by_id) == ["philly-2", "philly-8", "philly-4", "philly-7"]
    assert by_id["philly-2"].submit_time == 0.0
    assert by_id["philly-4"].submit_time == 1.5 * DAY
    assert by_id["philly-7"].submit_time == 7 * DAY - 1


def test_philly_teams_clamps_and_checkpoints_follow_the_rules():
    by_id = {j.spec.job_id: j for j in from_philly(FAKE_PHILLY, "philly.csv")}
    assert by_id["philly-4"].spec.team == "vc-bbb222"
    assert by_id["philly-4"].duration == 3 * DAY  # clamped from 999,999 s
    assert by_id["philly-7"].duration == 1.0  # clamped up from 0.4 s
    assert by_id["philly-8"].spec.checkpoint_interval == 1800.0 and by_id["philly-8"].spec.num_gpus == 4
    assert by_id["philly-2"].spec.checkpoint_interval is None
    assert all(j.spec.kind is JobKind.training and j.spec.topology is None for j in by_id.values())


def test_philly_conversion_is_deterministic_and_a_row_keeps_its_draws_in_any_window():
    week = from_philly(FAKE_PHILLY, "philly.csv", seed=5)
    assert week == from_philly(FAKE_PHILLY, "philly.csv", seed=5)
    later = from_philly(FAKE_PHILLY, "philly.csv", seed=5, start="2017-10-16 06:00:00", days=1)
    [same_row] = [j for j in later if j.spec.job_id == "philly-8"]
    [in_week] = [j for j in week if j.spec.job_id == "philly-8"]
    assert same_row.spec.priority == in_week.spec.priority
    assert same_row.spec.expected_duration == in_week.spec.expected_duration


def test_philly_priorities_follow_the_documented_mix():
    rows = "".join(
        f"2017-10-16 00:{i // 60 % 60:02d}:{i % 60:02d},60.0,1,60.0,aaa\n" for i in range(3000)
    )
    jobs = from_philly("timestamp,duration,num_gpus,gpu_time,cluster\n" + rows, "p.csv")
    counts = Counter(j.spec.priority for j in jobs)
    assert 0.48 < counts[Priority.normal] / 3000 < 0.56 and 0.26 < counts[Priority.low] / 3000 < 0.34


@pytest.mark.parametrize(
    "row, field",
    [
        ("16/10/2017 00:00,60.0,1,60.0,aaa", "timestamp"),
        ("2017-02-30 00:00:00,60.0,1,60.0,aaa", "timestamp"),
        ("2017-10-16 00:00:00,a minute,1,60.0,aaa", "duration"),
        ("2017-10-16 00:00:00,60.0,1.5,60.0,aaa", "num_gpus"),
        ("2017-10-16 00:00:00,60.0,1,60.0,", "cluster"),
        ("2017-10-16 00:00:00,60.0,1,60.0,a\x1bb", "cluster"),
        ("2017-10-16 00:00:00,60.0", None),
        ("2017-10-16 00:00:00,60.0,1,60.0,aaa,extra", None),
        ("2017-10-16 00:00:00,1_000,1,60.0,aaa", "duration"),
        ("2017-10-16 00:00:00,\u0661\u0660\u0660,1,60.0,aaa", "duration"),
        ("2017-10-16 00:00:00,60.0,1_0,60.0,aaa", "num_gpus"),
        ("2017-10-16 00:00:00,60.0,1,60.0," + "a" * 1100, "cluster"),
    ],
    ids=[
        "a timestamp in another format",
        "a date that does not exist",
        "a duration in words",
        "half a GPU",
        "no virtual cluster",
        "a virtual cluster with a control character",
        "a short row",
        "a long row, whose cells may have shifted",
        "a duration with an underscore",
        "a duration in another script's digits",
        "a GPU count with an underscore",
        "a virtual cluster's name too long to be a team's (and a fleet file's key)",
    ],
)
def test_a_malformed_philly_row_names_its_line_and_field(row, field):
    text = (
        "timestamp,duration,num_gpus,gpu_time,cluster\n2017-10-16 00:00:00,60.0,1,60.0,aaa\n"
        + row
        + "\n"
    )
    with pytest.raises(InputError) as caught:
        from_philly(text, "philly.csv")
    assert (caught.value.line, caught.value.field) == (3, field)


def test_a_file_that_is_not_philly_is_refused_at_the_header():
    with pytest.raises(InputError) as caught:
        from_philly("job_id,submit_time\n", "philly.csv")
    assert caught.value.line == 1 and "timestamp" in caught.value.field


def test_a_philly_header_naming_a_column_twice_is_refused():
    with pytest.raises(InputError) as caught:
        from_philly("timestamp,duration,num_gpus,gpu_time,cluster,cluster\n"
                    "2017-10-16 00:00:00,60.0,1,60.0,aaa,bbb\n", "philly.csv")
    assert (caught.value.line, caught.value.field) == (1, "cluster") and "twice" in caught.value.message


# --- Sizing a fleet ----------------------------------------------------------------------------


def uniform_jobs(
    count: int, num_gpus: int, duration: float, team: str = "t", kind=JobKind.training
) -> list[TraceJob]:
    return [
        TraceJob(
            spec=JobSpec(
                job_id=f"{team}-{i}", team=team, num_gpus=num_gpus, expected_duration=duration, kind=kind
            ),
            submit_time=i * DAY / count,
            duration=duration,
        )
        for i in range(count)
    ]


def test_a_fleet_is_sized_in_whole_racks_for_the_load():
    # 10 racks' worth of work (1,280 GPUs busy all day) at load 1.25 → 8 racks of 16 × 8 GPUs
    jobs = uniform_jobs(160, 8, DAY)
    fleet = parse_fleet(fleet_for(jobs, load=1.25, span=DAY), "fleet")
    assert fleet.total_gpus == 8 * 16 * 8
    assert offered_load(jobs, fleet.total_gpus, DAY) == pytest.approx(1.25)


def test_a_fleet_bigger_than_a_fleet_file_holds_is_refused_before_its_racks_are_laid_out():
    """A week-long job in a window of a minute asked for millions of GPUs: laying out their racks
    took minutes and gigabytes before the fleet file's limit refused them."""
    with pytest.raises(InputError, match="would have 4,838,400 GPUs; a fleet file holds at most 1,000,000"):
        fleet_for(uniform_jobs(1, 8, 7 * DAY), load=1.0, span=1.0)


def test_a_big_fleet_is_split_into_blocks_of_eight_racks():
    jobs = uniform_jobs(100, 8, 20 * 128 * DAY / 800)  # 20 racks' worth at load 1
    blocks = Counter(
        m.block for m in parse_fleet(fleet_for(jobs, load=1.0, span=DAY), "f").clusters[0].machines
    )
    assert blocks == {"b0": 128, "b1": 128, "b2": 64}


def test_the_fleet_fits_the_largest_job_even_when_load_would_say_less():
    jobs = uniform_jobs(1, 256, 600.0)
    assert parse_fleet(fleet_for(jobs, load=1.0, span=DAY), "f").total_gpus == 256


def test_a_job_kept_to_one_block_larger_than_eight_racks_gets_a_block_it_fits():
    """2,000 GPUs (topology left to the default, block) need 16 racks in one block, not two
    blocks of eight: the job would be refused on the fleet made for it."""
    fleet = parse_fleet(fleet_for(uniform_jobs(1, 2000, 600.0), load=1.0, span=DAY), "f")
    blocks = Counter(m.block for m in fleet.clusters[0].machines)
    assert blocks == {"b0": 256}


@pytest.mark.parametrize("inference_machines, laid_out", [(3, 3), (23, 24), (32, 32)],
                         ids=["fewer than a rack", "more than a rack: two racks of 12",
                              "two whole racks"])
def test_inference_work_gets_its_own_partition_and_the_load_and_quotas_count_its_machines(inference_machines,
                                                                                           laid_out):
    """Before, 23 machines of inference work were laid out as two racks of 16 (32), while the
    header's load and every quota's max counted 23."""
    jobs = (uniform_jobs(64, 8, DAY / 4)  # one rack of training work
            + uniform_jobs(inference_machines, 8, DAY, team="serve", kind=JobKind.inference))
    text = fleet_for(jobs, load=1.0, span=DAY)
    fleet = parse_fleet(text, "f")
    assert Counter(m.partition for m in fleet.clusters[0].machines) == {"training": 16, "inference": laid_out}
    assert all(q.max == fleet.total_gpus for q in fleet.quotas.values())
    assert f"on {fleet.total_gpus} GPUs" in text


def test_quotas_follow_each_teams_share_of_the_work():
    jobs = uniform_jobs(100, 8, DAY / 2, team="big") + uniform_jobs(100, 8, DAY / 6, team="small")
    fleet = parse_fleet(fleet_for(jobs, load=1.0, span=DAY), "f")
    total = fleet.total_gpus
    assert fleet.quotas["big"].guaranteed == int(0.9 * total * 0.75)
    assert fleet.quotas["small"].guaranteed == int(0.9 * total * 0.25)
    assert sum(q.guaranteed for q in fleet.quotas.values()) <= 0.9 * total
    assert all(q.max == total and q.queue_cap == 2000 for q in fleet.quotas.values())
    assert fleet.default_quota.guaranteed == 0 and fleet.default_quota.max == total


def test_team_names_that_yaml_would_misread_are_quoted():
    jobs = uniform_jobs(10, 8, DAY, team="1e3") + uniform_jobs(10, 8, DAY, team="yes")
    assert set(parse_fleet(fleet_for(jobs, load=1.0, span=DAY), "f").quotas) == {"1e3", "yes"}


def test_offered_gpu_seconds_counts_every_gpu():
    assert offered_gpu_seconds(uniform_jobs(3, 4, 100.0)) == 1200.0
