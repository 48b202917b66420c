"""`gpusched dev …`: the whole stack on this machine, for trying gpusched and for tests.

    gpusched dev up [--machines N] [--gpus-per-machine G] [--data-dir DIR] [--cluster C]
                    [--gpu-type T] [--fleet F.yaml] [--timeout S]
    gpusched dev status [--json] [--data-dir DIR]
    gpusched dev down [--purge] [--data-dir DIR]

Exit codes: 0 done (for `status`: every component healthy), 1 a component failed or is
unhealthy, 2 bad input. The stack itself lives in ``workers.devstack``; it is imported only when
a `dev` command runs, so the other commands do not load Temporal, asyncpg or boto3.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import threading
from pathlib import Path

from scheduler.errors import InputError
from workers.arg_types import gpu_type
from scheduler.fleet import MAX_GPUS_PER_MACHINE, name_problem
from workers.arg_types import count, positive_float, positive_int


def add_dev_commands(subparsers) -> None:
    """Add ``dev up``, ``dev status`` and ``dev down`` to a top-level argparse subparsers object."""
    dev = subparsers.add_parser(
        "dev", help="run the whole stack on this machine: Postgres, Temporal, S3 and the workers"
    )
    commands = dev.add_subparsers(dest="dev_command", required=True, metavar="{up,status,down,fault}")
    data_dir_help = "the stack's folder (default $GPUSCHED_DATA_DIR or ~/.gpusched)"

    up = commands.add_parser("up", help="start what is not running and wait until all is healthy")
    up.add_argument("--machines", type=count, default=None,
                    help="machines, one agent each (default: as before, else 2; 1 on a host with NVIDIA GPUs)")
    up.add_argument("--gpus-per-machine", type=positive_int, default=None,
                    help="GPUs per machine (default: as before, else 8)")
    up.add_argument("--cluster", default=None, help="cluster name (default: as before, else c1)")
    up.add_argument("--gpu-type", type=gpu_type, default=None, help="GPU type (default: as before, else H100)")
    up.add_argument("--fleet", default=None, metavar="F.yaml",
                    help="the machines of a fleet file (docs/traces.md, \"Fleet YAML\"; at most 64), with their places, GPU types "
                         "and partitions, and its quotas; instead of --machines, --gpus-per-machine, "
                         "--cluster and --gpu-type")
    up.add_argument("--data-dir", type=Path, default=None, help=data_dir_help)
    up.add_argument("--timeout", type=positive_float, default=90.0,
                    help="seconds to wait for every component to be healthy (default 90)")
    up.add_argument("--fake-devices", action="store_true", default=None,
                    help="agents use fake GPUs even where NVML finds real ones (kept for later `up`s)")
    up.set_defaults(func=run_up)

    status = commands.add_parser("status", help="show each component: pid, port, health")
    status.add_argument("--json", action="store_true", help="print the statuses as JSON")
    status.add_argument("--data-dir", type=Path, default=None, help=data_dir_help)
    status.set_defaults(func=run_status)

    down = commands.add_parser("down", help="stop the workers, then the servers; data is kept")
    down.add_argument("--purge", action="store_true", help="also delete the data directory")
    down.add_argument("--data-dir", type=Path, default=None, help=data_dir_help)
    down.set_defaults(func=run_down)

    fault = commands.add_parser("fault", help="inject a fault into a fake device (agents without NVML)")
    what = fault.add_subparsers(dest="fault_target", required=True, metavar="{gpu}")
    gpu = what.add_parser("gpu", help="make one GPU of a machine report a fault (or clear it)")
    gpu.add_argument("machine", help="machine id, e.g. c1/b0/r0/m0")
    gpu.add_argument("gpu", type=count, help="GPU index on the machine")
    kind = gpu.add_mutually_exclusive_group(required=True)
    kind.add_argument("--ecc", action="store_true", help="volatile uncorrectable ECC errors")
    kind.add_argument("--thermal", action="store_true", help="thermal throttling")
    kind.add_argument("--power", action="store_true", help="hardware power brake")
    kind.add_argument("--xid", type=positive_int, metavar="CODE", help="a critical XID event, e.g. 79")
    kind.add_argument("--lost", action="store_true", help="the GPU fell off the bus")
    kind.add_argument("--clear", action="store_true", help="clear this GPU's injected faults")
    gpu.add_argument("--data-dir", type=Path, default=None, help=data_dir_help)
    gpu.set_defaults(func=run_fault_gpu)


@contextlib.contextmanager
def stopped_as_by_ctrl_c():
    """SIGTERM and SIGHUP (a `timeout`, a closed terminal, a CI job cancelled) stop `dev up` as a
    ^C does: what it had started is recorded for `dev down`. Before, they ended it at once, its
    servers ran on unrecorded, and the next `up` started a second Temporal on the same data."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = {sig: signal.signal(sig, signal.default_int_handler) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def run_up(args: argparse.Namespace) -> int:
    from workers import devstack

    fleet = None
    if args.fleet is not None:
        alike = [flag for flag, value in (("--machines", args.machines), ("--gpus-per-machine", args.gpus_per_machine),
                                          ("--cluster", args.cluster), ("--gpu-type", args.gpu_type)) if value is not None]
        if alike:
            print(f"error: --fleet gives the machines; leave out {', '.join(alike)} (or the fleet file)", file=sys.stderr)
            return 2
        from workers.cli_fleet import read_live_fleet

        fleet = read_live_fleet(args.fleet)  # a quota's team no job could name is refused, as by `fleet apply`
        count = sum(len(c.machines) for c in fleet.clusters)
        if count > devstack.MAX_MACHINES:
            raise InputError(args.fleet, None, "clusters", (
                f"declares {count} machines; the embedded stack runs an agent process for each, at most "
                f"{devstack.MAX_MACHINES}: give `dev up` a smaller fleet file (declare a real fleet with "
                "`gpusched fleet apply`)"))
    for flag, value, most, why in (
            ("--machines", args.machines, devstack.MAX_MACHINES,
             "an agent process each; declare a real fleet with `gpusched fleet apply`"),
            ("--gpus-per-machine", args.gpus_per_machine, MAX_GPUS_PER_MACHINE, "as many as a heartbeat lists")):
        if value is not None and value > most:
            print(f"error: {flag} {value}: the embedded stack takes at most {most} ({why})", file=sys.stderr)
            return 2
    if args.cluster is not None and (problem := name_problem(args.cluster)) is not None:
        print(f"error: --cluster {args.cluster!r} {problem} (it becomes part of machine ids)", file=sys.stderr)
        return 2
    try:
        with stopped_as_by_ctrl_c():
            devstack.up(args.data_dir, machines=args.machines, gpus_per_machine=args.gpus_per_machine,
                        cluster=args.cluster, gpu_type=args.gpu_type, standard_ports=True,
                        timeout=args.timeout, fake_devices=args.fake_devices, fleet=fleet, out=sys.stdout)
    except (devstack.DataDirError, devstack.NotForThisHost) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except devstack.StackError as e:
        print(f"error: {e}", file=sys.stderr)
        print("the components that did start keep running: see `gpusched dev status`, "
              "stop them with `gpusched dev down`", file=sys.stderr)
        return 1
    except BrokenPipeError:  # our reader went away: main stops quietly
        raise
    except OSError as e:
        print(f"error: {_os_error(e)}", file=sys.stderr)
        return 1
    return 0


def run_status(args: argparse.Namespace) -> int:
    from workers import devstack

    try:
        statuses = devstack.status(args.data_dir)
    except devstack.DataDirError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except devstack.StackError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(devstack.status_json(statuses))
    elif not statuses:
        print(f"no stack in {devstack.resolve_data_dir(args.data_dir)} (start one with `gpusched dev up`)")
    else:
        print(f"{'component':<28} {'pid':>8} {'port':>6}  {'health':<9} machine")
        for s in statuses:
            down = s.pid is None and s.kind != "external"
            health = "healthy" if s.healthy else ("down" if down else "unhealthy")
            pid = "external" if s.kind == "external" else (s.pid or "-")
            print(f"{s.name:<28} {pid!s:>8} {s.port or '-'!s:>6}  {health:<9} {s.machine_id or ''}")
    return 0 if statuses and all(s.healthy for s in statuses) else 1


def run_down(args: argparse.Namespace) -> int:
    from workers import devstack

    where = devstack.resolve_data_dir(args.data_dir)
    try:
        had_stack = devstack.has_stack_file(where / devstack.STACK_FILE)
        stopped = devstack.down(args.data_dir, purge=args.purge)
    except devstack.DataDirError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except devstack.StackError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"error: {_os_error(e)}", file=sys.stderr)
        return 1
    if not stopped and not had_stack:
        print(f"no stack in {where}: nothing to stop")
        return 0
    print(f"stopped {len(stopped)} component(s)" + (f": {', '.join(stopped)}" if stopped else ""))
    print(f"deleted {where}" if args.purge else f"data kept in {where}; `gpusched dev up` resumes on it")
    return 0


def _os_error(e: OSError) -> str:
    return f"{e.filename}: {e.strerror or e}" if e.filename else str(e.strerror or e)


def run_fault_gpu(args: argparse.Namespace) -> int:
    """Write the fault into the machine's fault file, which its agent's fake devices read at every
    health check: the next heartbeat reports the GPU unhealthy, the scheduler stops using it, and
    a job running on it is moved (with its grace period to checkpoint)."""
    from workers import devices, devstack
    from workers.settings import machine_component

    data_dir = devstack.resolve_data_dir(args.data_dir)
    try:
        state = devstack.load_state(data_dir)
    except devstack.StackError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if state is None:
        print(f"error: no stack in {data_dir}; start one with `gpusched dev up`", file=sys.stderr)
        return 2
    machine = next((m for m in state.machines if m.id == args.machine.strip("/")), None)
    if machine is None:
        known = ", ".join(m.id for m in state.machines)
        print(f"error: machine: no machine '{args.machine}' in the stack (machines: {known})", file=sys.stderr)
        return 2
    if args.gpu >= machine.gpus:
        print(f"error: gpu: {machine.id} has GPUs 0-{machine.gpus - 1}", file=sys.stderr)
        return 2
    agent = state.components.get(machine_component(machine.id))
    if agent is not None and "--fake-devices" not in agent.cmd:
        # Only fake GPUs read the fault file: said done, nothing would have happened.
        print(f"error: machine: {machine.id}'s agent watches real GPUs through NVML; faults are played "
              "only on fake ones (a stack started with --fake-devices)", file=sys.stderr)
        return 2
    if args.xid is not None and args.xid not in devices.CRITICAL_XIDS:
        print(f"error: --xid: XID {args.xid} is not one that takes a GPU out of use (an application's, say), "
              f"which the agent ignores; give one of {', '.join(map(str, sorted(devices.CRITICAL_XIDS)))}",
              file=sys.stderr)
        return 2
    fault_file = data_dir / "faults" / f"{machine_component(machine.id)}.json"
    if args.clear:
        devices.clear_faults(fault_file, args.gpu)
        print(f"{machine.id}/{args.gpu}: faults cleared")
        return 0
    fault = (devices.ECC_UNCORRECTABLE if args.ecc else devices.THERMAL_THROTTLE if args.thermal
             else devices.POWER_THROTTLE if args.power else devices.LOST if args.lost
             else devices.xid_fault(args.xid))
    devices.inject_fault(fault_file, args.gpu, fault)
    print(f"{machine.id}/{args.gpu}: {fault} injected; its agent reports it with the next heartbeat")
    return 0
