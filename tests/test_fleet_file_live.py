"""The fleet file on the live stack (docs/traces.md: "Fleet YAML"):
`gpusched fleet apply` declares machines, partitions and quotas; `gpusched dev up --fleet`
runs a stack of the file's machines; inference jobs run on the inference partition only."""

from __future__ import annotations

import textwrap

import pytest

from live.jobs import Stack, sleeper
from scheduler.models import Quota
from workers.cli import main
from workflows.types import JobRequest

pytestmark = pytest.mark.live


def fleet_file(tmp_path, *, b0_partition: str = "training", inference_block: str = "inf", vision: int = 8) -> str:
    """c1: block b0 of two 4-GPU machines (in the partition asked), and a block of one 4-GPU
    inference machine; quotas for vision and every other team."""
    path = tmp_path / "fleet.yaml"
    path.write_text(textwrap.dedent(f"""\
        clusters:
          - name: c1
            blocks:
              - {{name: b0, racks: 1, machines_per_rack: 2, gpus_per_machine: 4, gpu_type: H100, partition: {b0_partition}}}
              - {{name: {inference_block}, racks: 1, machines_per_rack: 1, gpus_per_machine: 4, gpu_type: H100, partition: inference}}
        quotas:
          vision: {{guaranteed: {vision}, max: 16}}
          "*": {{guaranteed: 0, max: 4}}
        """))
    return str(path)


def machines(s: Stack) -> dict[str, tuple[str, list[int]]]:
    return {m["id"]: (m["partition"], m["gpus"]) for m in s.run(s.client.store.list_machines("c1"))}


def test_fleet_apply_declares_the_file_s_machines_partitions_and_quotas(stack, tmp_path, capsys):
    s = stack(machines=1, gpus=2)  # c1/b0/r0/m0 joined by its agent's heartbeat, with 2 GPUs
    d = ["--data-dir", str(s.data_dir)]
    assert main(["fleet", "apply", fleet_file(tmp_path), *d]) == 0
    out = capsys.readouterr().out
    assert "c1: 3 machines, 12 GPUs (1 inference, 2 training)" in out
    assert "2 machine(s) new to the store; 0 moved" in out and "quotas set: *, vision" in out
    # The machine its agent reported keeps its 2 GPUs; the declared ones have the file's 4 each.
    assert machines(s) == {"c1/b0/r0/m0": ("training", [0, 1]), "c1/b0/r0/m1": ("training", [0, 1, 2, 3]),
                           "c1/inf/r0/m0": ("inference", [0, 1, 2, 3])}
    assert s.run(s.client.quotas())["vision"] == Quota(guaranteed=8, max=16)
    assert s.run(s.client.quotas())["*"] == Quota(guaranteed=0, max=4)

    # Applied again, nothing is new; a file that moves block b0 to inference and drops a block
    # says so, and leaves the machine it does not declare as it was.
    assert main(["fleet", "apply", fleet_file(tmp_path), *d]) == 0
    assert "0 machine(s) new to the store; 0 moved" in capsys.readouterr().out
    assert main(["fleet", "apply", fleet_file(tmp_path, b0_partition="inference", inference_block="spare"), *d]) == 0
    out = capsys.readouterr().out
    assert "moved to another partition: c1/b0/r0/m0 (training -> inference), c1/b0/r0/m1 (training -> inference)" in out
    assert "1 machine(s) of these clusters are not in the file, left as they are: c1/inf/r0/m0" in out
    assert machines(s)["c1/b0/r0/m0"] == ("inference", [0, 1])
    assert machines(s)["c1/inf/r0/m0"] == ("inference", [0, 1, 2, 3])

    # A guarantee past the file's 12 GPUs is taken, and said.
    assert main(["fleet", "apply", fleet_file(tmp_path, vision=16), *d]) == 0
    err = capsys.readouterr().err
    assert ("cluster c1 has 12 GPUs (4 of them in the inference partition, for inference jobs only), but the "
            "teams' guarantees add up to 16 (vision 16)") in err
    assert s.run(s.client.quotas())["vision"] == Quota(guaranteed=16, max=16)


@pytest.mark.parametrize("content, words", [
    ("clusters:\n  - name: c1\n    blocks: []\n", "fleet.yaml:3: field 'clusters[0].blocks'"),
    ("clusters:\n  - name: c1\n    blocks:\n      - {name: b0, racks: 1, machines_per_rack: 1, gpus_per_machine: 4, "
     "gpu_type: H100}\nquotas:\n  vision: {guaranteed: 8, max: 4}\n", "fleet.yaml:6"),
    ("clusters: [", "fleet.yaml:1: is not valid YAML"),
    ("clusters:\n  - name: c1\n    blocks:\n      - {name: b0, racks: 1, machines_per_rack: 1, gpus_per_machine: 4, "
     "gpu_type: H100}\nquotas:\n  " + "t" * 200 + ": {guaranteed: 8}\n", "a team's name has at most 128"),
], ids=["a cluster without blocks", "a maximum below the guarantee", "broken YAML",
        "a team's name longer than the live stack takes"])
def test_fleet_apply_refuses_a_bad_file_naming_its_line_and_changes_nothing(stack, tmp_path, capsys, content, words):
    s = stack(machines=1, gpus=2)
    before = machines(s), s.run(s.client.quotas())
    path = tmp_path / "fleet.yaml"
    path.write_text(content)
    assert main(["fleet", "apply", str(path), "--data-dir", str(s.data_dir)]) == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err, err
    assert (machines(s), s.run(s.client.quotas())) == before


def test_a_stack_of_a_fleet_file_runs_inference_jobs_on_the_inference_partition_only(live_stack, tmp_path):
    from scheduler.fleet import parse_fleet

    path = fleet_file(tmp_path)
    fleet = parse_fleet(open(path).read(), path)
    s = Stack(live_stack(fleet=fleet, ui=False, control_args=["--tick", "0.5"]))
    try:
        assert sorted(m.machine_id for m in s.up.components if m.machine_id) == [
            "c1/b0/r0/m0", "c1/b0/r0/m1", "c1/inf/r0/m0"]
        assert s.run(s.client.quotas())["*"] == Quota(guaranteed=0, max=4)  # the file's (Stack sets vision's)
        for job_id, kind in (("serve", "inference"), ("train", "training")):
            s.run(s.client.submit(JobRequest(job_id=job_id, team="vision", num_gpus=4, command=sleeper(0.2),
                                             kind=kind)))
        ran = {j: s.wait(j) for j in ("serve", "train")}
        assert all(v.state == "succeeded" for v in ran.values()), ran
        assert {g.rsplit("/", 1)[0] for g in ran["serve"].attempts[0].gpus} == {"c1/inf/r0/m0"}
        assert {g.rsplit("/", 1)[0] for g in ran["train"].attempts[0].gpus} <= {"c1/b0/r0/m0", "c1/b0/r0/m1"}
        # A second inference job of the whole partition waits for it, beside free training GPUs.
        s.run(s.client.submit(JobRequest(job_id="serve-long", team="vision", num_gpus=4, command=sleeper(30),
                                         kind="inference")))
        s.until(lambda: s.status("serve-long").state == "running", timeout=30)
        s.run(s.client.submit(JobRequest(job_id="serve-next", team="vision", num_gpus=1, command=sleeper(0),
                                         kind="inference")))
        s.until(lambda: s.status("serve-next").reason, timeout=15)
        assert s.status("serve-next").state == "queued"
        s.run(s.client.cancel("serve-long"))
        assert s.wait("serve-next").state == "succeeded"
    finally:
        s.close()
