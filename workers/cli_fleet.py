"""`gpusched fleet apply F.yaml`: declare the live fleet with the fleet file the simulator reads
(the fleet YAML of docs/traces.md): each machine's place (cluster, block, rack), GPU type and partition,
and the teams' quotas.

Machines still join the live fleet by their agents' heartbeats (`--machine-id` names the place,
`c1/b0/r3/m7`), and one that joins undeclared is in the training partition: the file is how an
operator puts machines in the inference partition, and how the fleet and the quotas the
simulator was given become the live ones. A declared machine is scheduled on once its agent
heartbeats; until then it is unreachable, as a machine whose agent died.

`gpusched fleet token MACHINE_ID` prints the API token of one machine's agent: made from the API's
token, it lets that agent speak for its machine alone (workers/api.py), so the API's own token
stays off the machines.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from activities.rows import machine_id_problem
from scheduler.errors import InputError
from scheduler.fleet import guarantees_beyond_capacity, parse_fleet
from workers.arg_types import read_input
from workers.cli_jobs import EXIT_REFUSED, run_with_client
from workers.settings import SettingsError, is_machine_token, load_settings, machine_token
from workers.token_generations import FRESH_FOR_S
from workflows.types import team_problem


def add_fleet_commands(subparsers) -> None:
    fleet = subparsers.add_parser("fleet", help="declare the live fleet's machines and quotas from a fleet file")
    commands = fleet.add_subparsers(dest="fleet_command", required=True, metavar="{apply,token}")
    apply = commands.add_parser(
        "apply", help="register the file's machines (place, GPU type, partition) and set its quotas")
    apply.add_argument("file", help="a fleet YAML file (docs/traces.md, \"Fleet YAML\"), e.g. examples/fleet-small.yaml")
    apply.add_argument("--data-dir", type=Path, default=None, help="the embedded stack's directory")
    apply.set_defaults(func=cmd_fleet_apply)
    token = commands.add_parser(
        "token", help="print the API token for one machine's agent (its GPUSCHED_API_TOKEN): it speaks for "
                      "that machine alone")
    token.add_argument("machine_id", help="the machine's place, as its agent's --machine-id: c1/b0/r3/m7")
    token.add_argument("--data-dir", type=Path, default=None,
                       help="the embedded stack's directory, whose API token is taken unless GPUSCHED_API_TOKEN "
                            "is set")
    token.add_argument("--renew", action="store_true",
                       help="give the machine a new token and refuse its old one (within 5 s): for a machine taken "
                            "over or retired; its agent needs the new token to be heard again")
    token.set_defaults(func=cmd_fleet_token)


def cmd_fleet_token(args: argparse.Namespace) -> int:
    machine_id = args.machine_id.strip("/")
    if not machine_id or not machine_id.isprintable():
        raise InputError("machine_id", None, None, f"{args.machine_id!r} is no machine; give its place as its agent's "
                                                   "--machine-id names it, e.g. c1/b0/r3/m7")
    if (problem := machine_id_problem(machine_id)) is not None:  # no agent could speak for it
        raise InputError("machine_id", None, None, f"{problem}; give its place as its agent's --machine-id names it, "
                                                   "e.g. c1/b0/r3/m7")
    try:
        settings = load_settings(args.data_dir)
    except SettingsError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_REFUSED
    if not settings.api_token:
        print("error: the API has no token here: set GPUSCHED_API_TOKEN to the API's, or give --data-dir of a "
              "stack made by `gpusched dev up`", file=sys.stderr)
        return EXIT_REFUSED
    if is_machine_token(settings.api_token):
        print("error: GPUSCHED_API_TOKEN here is a machine's token, not the API's: a machine's token is made from "
              "the API's own; set that (or unset it and give --data-dir of the stack)", file=sys.stderr)
        return EXIT_REFUSED

    async def body(client) -> int:
        store = client.store
        generation = await (store.renew_machine_token(machine_id) if args.renew else store.token_generation(machine_id))
        print(machine_token(settings.api_token, machine_id, generation))
        if args.renew:
            print(f"{machine_id}: token renewed (generation {generation}); the API refuses the old one within "
                  f"{FRESH_FOR_S:g} s: give its agent the new one as GPUSCHED_API_TOKEN", file=sys.stderr)
        if not await store.machine_known(machine_id):  # not an error: a machine may get its token before it joins
            print(f"note: no machine {machine_id} has joined the fleet yet: is that its place, as its agent's "
                  "--machine-id names it?", file=sys.stderr)
        return 0

    return run_with_client(args, body)


def read_live_fleet(path: str):
    """A fleet file for the live stack (`fleet apply`, `dev up --fleet`): the simulator's checks
    and what the live stack takes of a team's name beyond them. Read before connecting: a bad file
    is refused (exit 2, file, line and field) with no stack."""
    fleet = parse_fleet(read_input(path, "fleet file"), path)
    for team in fleet.quotas:
        if (problem := team_problem(team)) is not None:
            raise InputError(path, None, f"quotas.{team[:40]}", problem)
    return fleet


def cmd_fleet_apply(args: argparse.Namespace) -> int:
    fleet = read_live_fleet(args.file)

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
        for warning in guarantees_beyond_capacity(fleet):
            print(f"warning: {args.file}: {warning}", file=sys.stderr)
        return 0

    return run_with_client(args, body)
