"""`gpusched fleet apply F.yaml`: declare the live fleet with the fleet file the simulator reads
(the fleet YAML of docs/traces.md): each machine's place (cluster, block, rack), GPU type and partition,
and the teams' quotas.

Machines still join the live fleet by their agents' heartbeats (`--machine-id` names the place,
`c1/b0/r3/m7`), and one that joins undeclared is in the training partition: the file is how an
operator puts machines in the inference partition, and how the fleet and the quotas the
simulator was given become the live ones. A declared machine is scheduled on once its agent
heartbeats; until then it is unreachable, as a machine whose agent died.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from scheduler.errors import InputError
from scheduler.fleet import parse_fleet
from workers.arg_types import read_input
from workers.cli_jobs import run_with_client
from workflows.types import team_problem


def add_fleet_commands(subparsers) -> None:
    fleet = subparsers.add_parser("fleet", help="declare the live fleet's machines and quotas from a fleet file")
    commands = fleet.add_subparsers(dest="fleet_command", required=True, metavar="{apply}")
    apply = commands.add_parser(
        "apply", help="register the file's machines (place, GPU type, partition) and set its quotas")
    apply.add_argument("file", help="a fleet YAML file (docs/traces.md, \"Fleet YAML\"), e.g. examples/fleet-small.yaml")
    apply.add_argument("--data-dir", type=Path, default=None, help="the embedded stack's directory")
    apply.set_defaults(func=cmd_fleet_apply)


def cmd_fleet_apply(args: argparse.Namespace) -> int:
    # Read before connecting: a bad file is refused (exit 2, file, line and field) with no stack.
    fleet = parse_fleet(read_input(args.file, "fleet file"), args.file)
    for team in fleet.quotas:  # what the live stack takes of a team's name, beyond the simulator
        if (problem := team_problem(team)) is not None:
            raise InputError(args.file, None, f"quotas.{team[:40]}", problem)

    async def body(client) -> int:
        applied = await client.store.apply_fleet(fleet)
        for cluster in fleet.clusters:
            partitions: dict[str, int] = {}
            for m in cluster.machines:
                partitions[m.partition] = partitions.get(m.partition, 0) + 1
            print(f"{cluster.name}: {len(cluster.machines)} machines, {cluster.total_gpus} GPUs ("
                  + ", ".join(f"{n} {name}" for name, n in sorted(partitions.items())) + ")")
        print(f"{len(applied.added)} machine(s) new to the store; "
              f"{len(applied.moved)} moved to another partition{': ' if applied.moved else ''}"
              + ", ".join(applied.moved))
        if applied.quotas:
            print(f"quotas set: {', '.join(applied.quotas)}")
        if applied.undeclared:
            shown = ", ".join(applied.undeclared[:5]) + (", ..." if len(applied.undeclared) > 5 else "")
            print(f"{len(applied.undeclared)} machine(s) of these clusters are not in the file, left as they are: "
                  f"{shown}")
        return 0

    return run_with_client(args, body)
