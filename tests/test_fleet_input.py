"""Reading fleet YAML: machines and quotas from a valid file, a precise error for every bad one."""

from __future__ import annotations

import textwrap

import pytest

from scheduler.errors import InputError
from scheduler.fleet import guarantees_beyond_capacity, parse_fleet
from scheduler.models import Quota


def fleet_yaml(body: str) -> str:
    return textwrap.dedent(body).lstrip("\n")


def block(name: str = "b0", **overrides) -> str:
    """One block as a flow mapping; keys set to None are left out."""
    keys = {"name": name, "racks": 1, "machines_per_rack": 1, "gpus_per_machine": 8, "gpu_type": "H100"}
    keys.update(overrides)
    return "{" + ", ".join(f"{k}: {v}" for k, v in keys.items() if v is not None) + "}"


VALID = fleet_yaml(
    """
    clusters:
      - name: c1
        blocks:
          - name: b0
            racks: 2
            machines_per_rack: 3
            gpus_per_machine: 8
            gpu_type: H100
          - name: inf
            racks: 1
            machines_per_rack: 2
            gpus_per_machine: 4
            gpu_type: L40S
            partition: inference
      - name: c2
        blocks:
          - {name: b0, racks: 1, machines_per_rack: 1, gpus_per_machine: 8, gpu_type: H200, gpu_memory_gb: 144}
          - {name: b1, racks: 1, machines_per_rack: 1, gpus_per_machine: 8, gpu_type: MI300X}
    quotas:
      vision: {guaranteed: 16, max: 64, queue_cap: 500}
      speech: {max: 32}
      "*": {max: 8}
    """
)


def test_a_valid_fleet_names_every_machine_by_its_position():
    fleet = parse_fleet(VALID, "fleet.yaml")
    c1 = fleet.cluster("c1")
    assert [m.id for m in c1.machines] == [
        "c1/b0/r0/m0", "c1/b0/r0/m1", "c1/b0/r0/m2",
        "c1/b0/r1/m0", "c1/b0/r1/m1", "c1/b0/r1/m2",
        "c1/inf/r0/m0", "c1/inf/r0/m1",
    ]  # fmt: skip
    last = c1.machines[-1]
    assert (last.cluster, last.block, last.rack, last.gpus, last.gpu_type) == (
        "c1",
        "inf",
        "r0",
        4,
        "L40S",
    )
    assert c1.total_gpus == 6 * 8 + 2 * 4
    assert fleet.total_gpus == c1.total_gpus + 16


@pytest.mark.parametrize("written", ["010", "0x1F", "1_000", "1.50", "7"],
                         ids=["a leading zero", "hexadecimal", "an underscore", "a decimal", "a plain number"])
def test_a_name_that_yaml_reads_as_a_number_keeps_its_spelling(written):
    fleet = parse_fleet(f"clusters:\n  - name: {written}\n    blocks:\n      - {block(written)}\n", "fleet.yaml")
    assert fleet.clusters[0].machines[0].id == f"{written}/{written}/r0/m0"


def test_partitions_default_to_training():
    fleet = parse_fleet(VALID, "fleet.yaml")
    partitions = {m.block: m.partition for m in fleet.cluster("c1").machines}
    assert partitions == {"b0": "training", "inf": "inference"}


@pytest.mark.parametrize(
    "cluster, block, memory",
    [("c1", "b0", 80.0), ("c1", "inf", 48.0), ("c2", "b0", 144.0), ("c2", "b1", 80.0)],
    ids=[
        "an H100 has 80 GB",
        "an L40S has 48 GB",
        "an explicit gpu_memory_gb wins over the type's default",
        "an unknown type gets 80 GB",
    ],
)
def test_gpu_memory_defaults_by_type(cluster, block, memory):
    machines = [
        m for m in parse_fleet(VALID, "fleet.yaml").cluster(cluster).machines if m.block == block
    ]
    assert {m.gpu_memory_gb for m in machines} == {memory}


def test_quotas_and_the_default_quota():
    fleet = parse_fleet(VALID, "fleet.yaml")
    assert fleet.quotas == {
        "vision": Quota(guaranteed=16, max=64, queue_cap=500),
        "speech": Quota(guaranteed=0, max=32, queue_cap=None),
    }
    assert fleet.default_quota == Quota(max=8)
    assert fleet.quota_for("vision").guaranteed == 16
    assert fleet.quota_for("nobody") == Quota(max=8)


def test_a_fleet_without_quotas_has_no_default():
    fleet = parse_fleet(f"clusters: [{{name: c1, blocks: [{block()}]}}]\n", "f.yaml")
    assert fleet.quotas == {} and fleet.default_quota is None and fleet.quota_for("x") is None


def test_asking_for_an_unknown_cluster_names_the_known_ones():
    with pytest.raises(KeyError, match="c1, c2"):
        parse_fleet(VALID, "fleet.yaml").cluster("c9")


def one_block(block_text: str, quotas: str = "") -> str:
    return f"clusters:\n  - name: c1\n    blocks:\n      - {block_text}\n{quotas}"


BAD_FLEETS = [
    ("", 1, "clusters", "needs a `clusters:`"),
    ("clusters: [\n", 2, None, "not valid YAML"),
    ("- c1\n- c2\n", 1, None, "must be a mapping"),
    ("quotas: {}\n", 1, "clusters", "add `clusters:`"),
    ("clusters: []\n", 1, "clusters", "at least one entry"),
    ("clusters:\n  - name: c1\n", 2, "clusters[0].blocks", "add `blocks:`"),
    ("clusters:\n  - name: c1\n    blocks: []\n", 3, "clusters[0].blocks", "at least one entry"),
    (one_block(block(racks=None)), 4, "clusters[0].blocks[0].racks", "add `racks:`"),
    (
        one_block(block(racks="eight")),
        4,
        "clusters[0].blocks[0].racks",
        "must be a positive integer, got 'eight'",
    ),
    (
        one_block(block(gpus_per_machine=0)),
        4,
        "clusters[0].blocks[0].gpus_per_machine",
        "positive integer, got 0",
    ),
    (
        one_block(block(machines_per_rack=2.5)),
        4,
        "clusters[0].blocks[0].machines_per_rack",
        "positive integer, got 2.5",
    ),
    (one_block(block(name="'b/0'")), 4, "clusters[0].blocks[0].name", "without '/'"),
    (
        one_block(block(gpu_memory_gb=-1)),
        4,
        "clusters[0].blocks[0].gpu_memory_gb",
        "positive number, got -1",
    ),
    (one_block(block(rakcs=8)), 4, "clusters[0].blocks[0].rakcs", "did you mean 'racks'?"),
    (
        "clusters:\n  - name: c1\n    blocks:\n      - "
        + block("b0")
        + "\n      - "
        + block("b0")
        + "\n",
        5,
        "clusters[0].blocks[1].name",
        "already used on line 4",
    ),
    (
        "clusters:\n  - name: c1\n    blocks: ["
        + block()
        + "]\n  - name: c1\n    blocks: ["
        + block()
        + "]\n",
        4,
        "clusters[1].name",
        "give each cluster its own name",
    ),
    ("zones: 3\nclusters: []\n", 1, "zones", "allowed keys: clusters, quotas"),
    ("clusters: 1\nclusters: 2\n", 2, "clusters", "appears twice"),
    (
        one_block(block(), "quotas:\n  vision: 64\n"),
        6,
        "quotas.vision",
        "must be a mapping like {guaranteed: 64",
    ),
    (
        one_block(block(), "quotas:\n  vision: {guaranteed: -4}\n"),
        6,
        "quotas.vision.guaranteed",
        "0 or more, got -4",
    ),
    (one_block(block(), "quotas:\n  vision: {max: lots}\n"), 6, "quotas.vision.max", "got 'lots'"),
    (
        one_block(block(), "quotas:\n  vision: {guarantee: 4}\n"),
        6,
        "quotas.vision.guarantee",
        "did you mean 'guaranteed'?",
    ),
    (
        one_block(block(), "quotas:\n  vision:\n    guaranteed: 64\n    max: 32\n"),
        8,
        "quotas.vision.max",
        "raise max to at least 64 or lower guaranteed",
    ),
    ("clusters: []\n---\nclusters: []\n", 2, None, "more than one YAML document"),
    (one_block(block(racks="!!int abc")), 4, "clusters[0].blocks[0].racks", "got !!int 'abc', which is no value"),
    (one_block(block(gpu_memory_gb="!!bool maybe")), 4, "clusters[0].blocks[0].gpu_memory_gb",
     "got !!bool 'maybe'"),
    (one_block(block(gpu_type="!foo H100")), 4, "clusters[0].blocks[0].gpu_type", "got !foo 'H100'"),
    (one_block(block(gpus_per_machine=10**20)), 4, "clusters[0].blocks[0].gpus_per_machine", "at most 1024 GPUs"),
    (one_block(block(gpu_memory_gb=10**400)), 4, "clusters[0].blocks[0].gpu_memory_gb", "at most 100,000"),
    (one_block(block(racks=10**8, machines_per_rack=10**8)), 4, "clusters[0].blocks[0].racks",
     "split it into several blocks"),
    (one_block(block(racks=600, machines_per_rack=100) + "\n      - " + block("b1", racks=600, machines_per_rack=100)),
     5, "clusters[0].blocks[1].racks", "brings the fleet to 120000 machines; a fleet file holds at most 100000"),
    (one_block(block(), "quotas:\n  vision:\n    guaranteed: 8\n    max: 3000000000\n"), 8, "quotas.vision.max",
     "at most 2147483647 GPUs"),
    (one_block(block(), "quotas:\n  ~: {guaranteed: 8}\n"), 6, "quotas", "a team's name must be plain text"),
    (one_block(block(), "quotas:\n  [a, b]: {guaranteed: 8}\n"), 6, "quotas", "a team's name must be plain text"),
    (one_block(block(partition="Inference")), 4, "clusters[0].blocks[0].partition",
     "the inference partition is spelt 'inference'"),
    ("clusters: " + "[" * 2000 + "]" * 2000 + "\n", 1, None, "nests lists or mappings too deeply"),
    (one_block(block(), "quotas:\n  vision:\n    guaranteed: " + "[" * 2000 + "]" * 2000 + "\n"), 7, None,
     "nests lists or mappings too deeply"),
    (one_block(block(racks=1000, machines_per_rack=100, gpus_per_machine=1024)), 4,
     "clusters[0].blocks[0].gpus_per_machine", "brings the fleet to 102400000 GPUs; a fleet file holds at most 1000000"),
    (one_block(block(name='"b\\0"')), 4, "clusters[0].blocks[0].name", "printable characters"),
    (one_block(block(gpu_type='"H100\\u202e"')), 4, "clusters[0].blocks[0].gpu_type", "printable characters"),
    (one_block(block(), 'quotas:\n  "vis\\x07ion": {guaranteed: 8}\n'), 6, "quotas",
     "a team's name must be plain text"),    (one_block(block(racks="010")), 4, "clusters[0].blocks[0].racks", "is written '010', which YAML reads as 8"),
    (one_block(block(machines_per_rack="1:00")), 4, "clusters[0].blocks[0].machines_per_rack",
     "which YAML reads as 60; write it in plain decimal digits"),
    (one_block(block(gpu_memory_gb="1_000.5")), 4, "clusters[0].blocks[0].gpu_memory_gb", "reads as 1000.5"),
    (one_block(block(), "quotas:\n  vision: {guaranteed: 0x100}\n"), 6, "quotas.vision.guaranteed",
     "is written '0x100', which YAML reads as 256"),
    ("# a page break \x0c\nclusters: []\n", 1, None, "holds the control character U+000C"),
    ("clusters:\n  - name: c1\x1b\n", 2, None, "holds the control character U+001B"),
    (one_block(block(name="b" * 65)), 4, "clusters[0].blocks[0].name", "a name of up to 64 printable characters"),
    ("clusters:\n  - name: " + "c" * 995 + "\n    blocks: []\n", 2, "clusters[0].name", "up to 64"),
    (one_block(block(gpu_type="G" * 201)), 4, "clusters[0].blocks[0].gpu_type", "is 201 characters; at most 200"),
]


@pytest.mark.parametrize(
    "text, line, field, fix",
    BAD_FLEETS,
    ids=[
        "an empty file asks for clusters",
        "broken YAML points at where parsing stopped",
        "a list at the top is not a fleet",
        "a fleet without clusters says to add them",
        "an empty cluster list is refused",
        "a cluster without blocks says to add them",
        "an empty block list is refused",
        "a block without racks says to add them",
        "racks spelled out in words is not a number",
        "a machine with zero GPUs is refused",
        "a fractional machine count is refused",
        "a block name with a slash would break machine ids",
        "negative GPU memory is refused",
        "a misspelt key gets a suggestion",
        "two blocks with one name in a cluster",
        "two clusters with one name",
        "an unknown top-level key lists the allowed ones",
        "a key given twice",
        "a bare number as a quota",
        "a negative guarantee",
        "a max that is not a number",
        "a misspelt quota key gets a suggestion",
        "a max below the guarantee says how to fix it",
        "two YAML documents in one file",
        "a tagged value its tag cannot read",
        "a tagged flag its tag cannot read",
        "an unknown tag",
        "a machine of more GPUs than any",
        "a GPU memory of 400 digits, which overflowed a float (a traceback)",
        "a block of more machines than any",
        "blocks adding up to more machines than any fleet, refused before they are built",
        "a quota beyond what the store holds",
        "a null team name",
        "a list as a team name",
        "an inference partition with a capital letter, which would make it a training one",
        "lists nested thousands deep, which the YAML reader would recurse into",
        "a quota nested thousands deep",
        "machines of GPUs adding up to more than any fleet, refused before they are built",
        "a block name with a NUL character",
        "a GPU type with a right-to-left override",
        "a team name with a control character",
        "a count YAML reads as octal",
        "a count YAML reads as minutes and seconds",
        "a memory size with an underscore",
        "a quota in hexadecimal",
        "a control character in a comment, which the YAML reader refuses before reading anything",
        "a control character in a value, on its line",
        "a block name longer than machine ids take",
        "a cluster name longer than machine ids take, which took every control worker down",
        "a GPU type longer than a heartbeat takes, whose machines never joined",
    ],
)
def test_a_bad_fleet_file_names_line_field_and_fix(text, line, field, fix):
    with pytest.raises(InputError) as caught:
        parse_fleet(text, "fleet.yaml")
    error = caught.value
    assert (error.source, error.line, error.field) == ("fleet.yaml", line, field)
    assert fix in error.message
    assert str(error).startswith(f"fleet.yaml:{line}:")


DEFAULT_ENTRY = '"*"'


def quotas_of(**guarantees: int) -> str:
    """Quota lines; `default` is the "*" entry."""
    return "".join(f"  {DEFAULT_ENTRY if team == 'default' else team}: {{guaranteed: {n}}}\n"
                   for team, n in guarantees.items())


@pytest.mark.parametrize(
    "clusters, guarantees, warned, named",
    [
        pytest.param("c1:8", {"vision": 4, "speech": 4}, [], [], id="guarantees that fill the cluster exactly are no warning"),
        pytest.param("c1:8", {"vision": 8, "speech": 1}, ["c1"], ["vision 8", "speech 1"],
                     id="guarantees past the cluster's GPUs are warned of, the largest first"),
        pytest.param("c1:16,c2:8", {"vision": 6, "speech": 6}, ["c2"], ["speech 6", "vision 6"],
                     id="each cluster is held to the quotas alone: only the smaller one is warned of"),
        pytest.param("c1:8", {"vision": 0, "speech": 9}, ["c1"], ["speech 9"], id="a team with no guarantee is not named"),
        pytest.param("c1:8", {"vision": 4, "default": 5}, ["c1"], ['"*" (each team without its own entry) 5', "vision 4"],
                     id="the default's guarantee counts once, for any team without its own entry"),
    ],
)
def test_guarantees_beyond_a_clusters_gpus_are_warned_of_not_refused(clusters, guarantees, warned, named):
    blocks = "".join(
        f"  - {{name: {name}, blocks: [{block(machines_per_rack=int(gpus) // 8)}]}}\n"
        for name, gpus in (c.split(":") for c in clusters.split(","))
    )
    fleet = parse_fleet(f"clusters:\n{blocks}quotas:\n{quotas_of(**guarantees)}", "f.yaml")
    warnings = guarantees_beyond_capacity(fleet)
    assert [w.split()[1] for w in warnings] == warned
    for w in warnings:
        assert f"add up to {sum(guarantees.values())} ({', '.join(named)}):" in w and "lower the guarantees" in w


def test_a_clusters_inference_gpus_are_named_in_the_warning():
    fleet = parse_fleet(f"clusters:\n  - {{name: c1, blocks: [{block()}, {block('inf', partition='inference')}]}}\n"
                        f"quotas:\n{quotas_of(vision=20)}", "f.yaml")
    assert guarantees_beyond_capacity(fleet)[0].startswith(
        "cluster c1 has 16 GPUs (8 of them in the inference partition, for inference jobs only), "
        "but the teams' guarantees add up to 20 (vision 20)")


def test_a_fleet_file_too_long_for_any_fleet_is_refused_before_it_is_read():
    """A 5 MB YAML list took 1.6 GB and two minutes before its unknown key was refused: the
    reader builds the whole document first (a helper's fuzzing)."""
    text = "clusters: []\njunk: [" + "1," * (1 << 19) + "1]\n"
    with pytest.raises(InputError) as caught:
        parse_fleet(text, "f.yaml")
    assert caught.value.line is None and "a fleet file is at most 1,048,576" in str(caught.value)


@pytest.mark.parametrize("command", [["fleet", "apply"], ["dev", "up", "--fleet"]],
                         ids=["fleet apply", "dev up --fleet"])
def test_a_live_fleet_file_with_a_team_no_job_could_name_is_refused_before_anything_starts(
        tmp_path, capsys, command):
    """`dev up --fleet` set the quota of a 200-character team, which no job could be submitted
    for and `quota set` could not change; `fleet apply` refused it."""
    from workers.cli import main

    path = tmp_path / "fleet.yaml"
    path.write_text("clusters:\n  - name: c1\n    blocks:\n      - {name: b0, racks: 1, machines_per_rack: 1, "
                    "gpus_per_machine: 4, gpu_type: H100}\nquotas:\n  " + "t" * 200 + ": {guaranteed: 4}\n")
    data_dir = tmp_path / "stack"
    assert main([*command, str(path), "--data-dir", str(data_dir)]) == 2
    assert "a team's name has at most 128" in capsys.readouterr().err
    assert not data_dir.exists()  # nothing was started
