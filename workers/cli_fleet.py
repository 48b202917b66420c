"""`gpusched fleet apply F.yaml`: declare the live fleet with the fleet file the simulator reads
(the fleet YAML of docs/traces.md): each machine's place (cluster, block, rack), GPU type and partition,
and the teams' quotas.

Machines still join the live fleet by their agents' heartbeats (`--machine-id` names the place,
`c1/b0/r3/m7`), and one that joins undeclared is in the training partition: the file is how an
operator puts machines in the inference partition, and how the fleet and the quotas the
simulator was given become the live ones. A declared machine is scheduled on once its agent
heartbeats; until then it is unreachable, as a machine whose agent died.

`gpusched fleet cordon | drain | uncordon MACHINE_ID` takes a machine out of service (nothing new
goes there; a drain also moves its jobs off, each with a checkpoint) and puts it back; `gpusched
fleet list` shows each machine's state.

`gpusched fleet token MACHINE_ID` prints the API token of one machine's agent: made from the API's
token, it lets that agent speak for its machine alone (workers/api.py), so the API's own token
stays off the machines.
"""

from __future__ import annotations

import argparse
import json
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
    commands = fleet.add_subparsers(dest="fleet_command", required=True,
                                    metavar="{apply,list,cordon,drain,uncordon,token}")
    apply = commands.add_parser(
        "apply", help="register the file's machines (place, GPU type, partition) and set its quotas")
    apply.add_argument("file", help="a fleet YAML file (docs/traces.md, \"Fleet YAML\"), e.g. examples/fleet-small.yaml")
    apply.add_argument("--data-dir", type=Path, default=None, help="the embedded stack's directory")
    apply.set_defaults(func=cmd_fleet_apply)
    listing = commands.add_parser("list", help="the live fleet's machines: GPUs, partition, state, jobs on them")
    listing.add_argument("--cluster", default=None, help="only this cluster's machines")
    listing.add_argument("--json", action="store_true", help="one JSON list, for scripts")
    listing.add_argument("--data-dir", type=Path, default=None, help="the embedded stack's directory")
    listing.set_defaults(func=cmd_fleet_list)
    for name, mode, what in (
        ("cordon", "cordoned", "take a machine out of service: nothing new is placed there; its jobs run on"),
        ("drain", "draining", "empty a machine for maintenance: nothing new is placed there, and its jobs are "
                              "asked to checkpoint and move, with their grace"),
        ("uncordon", None, "put a cordoned or drained machine back in service"),
    ):
        command = commands.add_parser(name, help=what)
        command.add_argument("machine_id", help="the machine's place, as `gpusched fleet list` shows it: c1/b0/r3/m7")
        if mode is not None:
            command.add_argument("--reason", default=None,
                                 help=f"why, in a few words (at most {MAX_CORDON_REASON} characters), shown with "
                                      "the machine")
        command.add_argument("--data-dir", type=Path, default=None, help="the embedded stack's directory")
        command.set_defaults(func=cmd_fleet_cordon, mode=mode)
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


MAX_CORDON_REASON = 200


def _machine_id(given: str) -> str:
    """The machine's id as the fleet names it; refused (exit 2) when no machine could be named so."""
    machine_id = given.strip("/")
    if not machine_id or not machine_id.isprintable():
        raise InputError("machine_id", None, None, f"{given!r} is no machine; give its place as its agent's "
                                                   "--machine-id names it, e.g. c1/b0/r3/m7")
    if (problem := machine_id_problem(machine_id)) is not None:  # no agent could speak for it
        raise InputError("machine_id", None, None, f"{problem}; give its place as its agent's --machine-id names it, "
                                                   "e.g. c1/b0/r3/m7")
    return machine_id


def cmd_fleet_cordon(args: argparse.Namespace) -> int:
    """`fleet cordon`, `fleet drain` and `fleet uncordon`: the store keeps the machine's state,
    which the next cycle reads (scheduler/health.py moves a drained machine's jobs off)."""
    machine_id = _machine_id(args.machine_id)
    reason = getattr(args, "reason", None)
    if reason is not None:
        reason = " ".join(reason.split())
        if not reason or not reason.isprintable() or len(reason) > MAX_CORDON_REASON:
            raise InputError("reason", None, None, f"give a few printable words, at most {MAX_CORDON_REASON} "
                                                   "characters (or leave --reason out)")

    async def body(client) -> int:
        jobs = await client.store.cordon(machine_id, args.mode, reason)
        if jobs is None:
            print(f"error: machine_id: no machine {machine_id} in the fleet; `gpusched fleet list` lists them",
                  file=sys.stderr)
            return EXIT_REFUSED
        why = f" ({reason})" if reason else ""
        if args.mode is None:
            machines = await client.store.list_machines(machine_id.split("/", 1)[0])  # its cluster's
            print(f"{machine_id}: {uncordoned_state(machines, machine_id)}")
        elif args.mode == "cordoned":
            print(f"{machine_id}: cordoned{why}: nothing new is placed there; its {jobs} job(s) run on")
        else:
            print(f"{machine_id}: draining{why}: nothing new is placed there, and its {jobs} job(s) are asked "
                  "to checkpoint and move within their grace; `gpusched fleet list` shows when it is empty")
        return 0

    return run_with_client(args, body)


def uncordoned_state(machines: list[dict], machine_id: str) -> str:
    """What an uncordon gave back, in words: a machine whose agent is not heard is not in service
    by being uncordoned."""
    m = next((m for m in machines if m["id"] == machine_id), None)
    if m is not None and not m["reachable"]:
        return "uncordoned, but unreachable: it takes work once its agent is heard again"
    if m is not None and not m["takes_work"]:
        return "uncordoned, but taking no work until its agent answers"
    return "back in service; the next cycle may place jobs there"


def machine_state(m: dict) -> str:
    """A listed machine's state in words: what keeps work off it, most telling first."""
    why = f" ({m['cordon_reason']})" if m.get("cordon_reason") else ""
    if not m["reachable"]:  # and still out of service once its agent is back, if it was taken out
        out = {"draining": f"; drained{why}", "cordoned": f"; cordoned{why}"}.get(m.get("cordon"), "")
        return f"unreachable{out}"
    if m.get("cordon") == "draining":
        return (f"draining{why}, {m['allocations']} job(s) left" if m["allocations"] else f"drained{why}")
    if m.get("cordon") == "cordoned":
        return f"cordoned{why}"
    return "up" if m["takes_work"] else "up, taking no work (its agent owes an answer or is starting)"


def cmd_fleet_list(args: argparse.Namespace) -> int:
    async def body(client) -> int:
        machines = await client.store.list_machines(args.cluster)
        if args.json:
            shown = [{"id": m["id"], "cluster": m["cluster"], "gpus": len(m["gpus"]), "gpu_type": m["gpu_type"],
                      "gpu_memory_gb": m["gpu_memory_gb"], "partition": m["partition"], "reachable": m["reachable"],
                      "takes_work": m["takes_work"], "cordon": m["cordon"], "cordon_reason": m["cordon_reason"],
                      "state": machine_state(m), "jobs": m["job_ids"], "unhealthy_gpus": m["unhealthy"] or []}
                     for m in machines]
            print(json.dumps(shown, indent=2))
            return 0
        if not machines:
            print("no machines" + (f" in cluster {args.cluster}" if args.cluster else "") + " have joined yet")
            return 0
        width = max(len(m["id"]) for m in machines)
        for m in machines:
            sick = f", unhealthy GPUs {','.join(map(str, m['unhealthy']))}" if m["unhealthy"] else ""
            ids = m["job_ids"]
            jobs = f": {', '.join(ids[:5])}{', ...' if len(ids) > 5 else ''}" if ids else ""
            print(f"{m['id']:<{width}}  {len(m['gpus'])} x {m['gpu_type']:<6} {m['partition']:<9} "
                  f"{machine_state(m)}{sick}; jobs {len(ids)}{jobs}")
        return 0

    return run_with_client(args, body)


def cmd_fleet_token(args: argparse.Namespace) -> int:
    machine_id = _machine_id(args.machine_id)
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
