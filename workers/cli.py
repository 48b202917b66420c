"""The `gpusched` command. Reads and writes files; every decision is made in scheduler/.

Exit codes: 0 success, 2 bad input (the message names the file, line and field), 1 otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import time
from pathlib import Path

from pydantic import ValidationError

from scheduler.errors import InputError
from scheduler.fleet import Fleet, guarantees_beyond_capacity, parse_fleet
from scheduler.models import PolicyConfig
from scheduler.sim.engine import POLICIES, SimSettings, check_failure_rates, simulate
from scheduler.sim.report import COMPARISON_FILES, RUN_FILES, SUMMARY_JSON, write_comparison, write_json, write_run
from scheduler.sim.trace import TraceJob, parse_trace
from workers.arg_types import finite, read_input, same_file
from workers.cli_dev import add_dev_commands
from workers.cli_fleet import add_fleet_commands
from workers.cli_jobs import add_job_commands
from workers.example_job import add_example_job_command
from workers.settings import loopback_without_proxy
from workers.cli_trace import add_trace_commands
from workflows.types import first_error, flag_for


def load_inputs(trace_path: str, fleet_path: str) -> tuple[list[TraceJob], Fleet]:
    fleet = parse_fleet(read_input(fleet_path, "fleet file"), fleet_path)
    clusters = [c.name for c in fleet.clusters]

    def against_fleet(job: TraceJob) -> tuple[str, str] | None:
        spec = job.spec
        if spec.cluster is not None and spec.cluster not in clusters:
            return "cluster", (f"job {spec.job_id} names cluster '{spec.cluster}', which {fleet_path} "
                               f"does not have ({', '.join(clusters)}); name one of those or leave it empty")
        if fleet.default_quota is None and spec.team not in fleet.quotas:
            return "team", (f"team '{spec.team}' (job {spec.job_id}) has no quota in {fleet_path}; "
                            "add it under 'quotas:' or add a '\"*\"' default quota")
        return None

    trace = parse_trace(read_input(trace_path, "trace"), trace_path, check=against_fleet)
    return trace, fleet


def _check_writable(out: Path, policies: list[str], inputs: dict[str, str]) -> None:
    """Refuse, before hours of simulation and not after, an output folder where a result could
    not be written: DIR and each compared policy's DIR/<name>, and every file they will hold;
    and one where a result would overwrite an input (`--out` the trace's own folder, holding it
    as jobs.csv)."""
    folders = {out: RUN_FILES + (COMPARISON_FILES if len(policies) > 1 else ())}
    folders.update({out / name: RUN_FILES for name in policies[1:]})
    for folder, files in folders.items():
        for name in files:
            for flag, given in inputs.items():
                if same_file(given, folder / name):
                    raise InputError(str(folder / name), None, "--out", (
                        f"is the {flag} file {given}: the results would overwrite it; give --out another folder"))
    for folder, files in folders.items():
        try:
            folder.mkdir(parents=True, exist_ok=True)
            if not os.access(folder, os.W_OK):
                raise PermissionError(13, "Permission denied")
            for name in files:
                path = folder / name
                if path.is_dir():
                    raise IsADirectoryError(21, f"{name} there is a folder")
                # A link to nowhere is written through to its target, unless its folder is missing.
                if path.is_symlink() and not path.exists() and not Path(os.path.realpath(path)).parent.is_dir():
                    raise FileNotFoundError(2, f"{name} there is a link to {os.readlink(path)}, whose folder does not exist")
                if path.exists() and not os.access(path, os.W_OK):
                    raise PermissionError(13, f"{name} there is read-only")
                if path.is_fifo() or path.is_socket():  # writing would wait for a reader forever
                    raise OSError(6, f"{name} there is a {'pipe' if path.is_fifo() else 'socket'}, not a file")
        except OSError as e:
            raise InputError(str(folder), None, "--out", f"cannot write the results here ({e.strerror}); "
                                                         "give --out a folder you can write") from None


@contextlib.contextmanager
def _results_to(folder: Path):
    """A result that cannot be written after all (the disk filled, a file of the folder turned
    into a dangling link meanwhile) is one line naming the file, not a traceback."""
    try:
        yield
    except OSError as e:
        where = e.filename or folder
        raise InputError(str(where), None, "--out", f"cannot write the results here ({e.strerror or e}); "
                                                     "free some space or give --out another folder") from None


def cmd_simulate(args: argparse.Namespace) -> int:
    trace, fleet = load_inputs(args.trace, args.fleet)
    if args.compare is not None and not args.compare:  # `--compare ,` would quietly compare nothing
        raise InputError("--compare", None, None, f"names no policy; give some of {', '.join(POLICIES)}, "
                         "comma-separated, e.g. --compare fifo,easy")
    names = list(dict.fromkeys([args.policy, *(args.compare or [])]))  # each policy once
    for name in names:
        if name not in POLICIES:
            raise InputError("--policy/--compare", None, None,
                             f"unknown policy '{name}'; choose from {', '.join(POLICIES)}")
    try:
        settings = SimSettings(
            policy=PolicyConfig(stagger_checkpoints=not args.no_stagger,
                                expected_restart_s=args.expected_restart_s or 0.0),
            learn_restart=args.expected_restart_s is None,
            machine_failures_per_day=args.machine_failures_per_day,
            gpu_failures_per_day=args.gpu_failures_per_day,
            restart_s=args.restart_s,
            seed=args.seed,
            until=args.until,
        )
    except ValidationError as e:
        field, message = first_error(e)
        flag = flag_for(field)
        raise InputError("simulate", None, flag, f"{message}; give {flag} a valid value") from None
    check_failure_rates(trace, fleet, settings)
    if not args.out.strip():  # Path("") is the current folder: the results would land anywhere
        raise InputError("simulate", None, "--out", "is empty; give the folder for the results")
    out = Path(args.out)
    _check_writable(out, names, {"--trace": args.trace, "--fleet": args.fleet})
    for warning in guarantees_beyond_capacity(fleet):
        print(f"warning: {args.fleet}: {warning}", file=sys.stderr)
    summaries = {}
    for name in names:
        began = time.perf_counter()
        result = simulate(trace, fleet, name, settings, stopwatch=time.perf_counter)
        elapsed = time.perf_counter() - began
        # The chosen policy's files go straight into DIR; compared baselines into DIR/<name>.
        folder = out if name == names[0] else out / name
        with _results_to(folder):
            summary = write_run(result, folder)
            summary["simulation_wall_s"] = round(elapsed, 2)
            write_json(summary, folder / SUMMARY_JSON)
        summaries[name] = summary
        if not args.json:
            rejected = summary["wait_s"]["all"]["rejected"]
            note = f" ({rejected} rejected at submit; jobs.csv says why)" if rejected else ""
            print(f"{name}: {len(trace)} jobs simulated in {elapsed:.1f} s{note} -> "
                  f"{out if name == names[0] else out / name}", file=sys.stderr)
    if len(names) > 1:
        with _results_to(out):
            table = write_comparison(summaries, out)
        if not args.json:
            print(table)
    if args.json:
        print(json.dumps(summaries[names[0]], indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gpusched", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)

    sim = commands.add_parser("simulate", help="replay a trace on a fleet with a policy")
    sim.add_argument("--trace", required=True, help="trace CSV (see docs/traces.md)")
    sim.add_argument("--fleet", required=True, help="fleet YAML (see docs/traces.md)")
    sim.add_argument("--policy", default="gpusched", type=str.strip, help=f"one of {', '.join(POLICIES)} (default gpusched)")
    sim.add_argument("--compare", default=None, type=lambda s: [p.strip() for p in s.split(",") if p.strip()],
                     help="also run these policies, e.g. fifo,easy; each goes into DIR/<name>")
    sim.add_argument("--out", required=True, help="output folder")
    sim.add_argument("--json", action="store_true", help="print summary.json to stdout")
    sim.add_argument("--machine-failures-per-day", type=finite, default=0.0,
                     help="failure injection: failures per machine per day (repaired after 30 min)")
    sim.add_argument("--gpu-failures-per-day", type=finite, default=0.0, help="failures per GPU per day")
    sim.add_argument("--restart-s", type=finite, default=0.0,
                     help="seconds every attempt after a job's first spends starting again (a new process, "
                          "its checkpoint loaded) before it progresses (default 0)")
    sim.add_argument("--expected-restart-s", type=finite, default=None,
                     help="what the scheduler expects a resumed job's restart to take "
                          "(PolicyConfig.expected_restart_s); default: learned from the first restart, "
                          "as the live loop learns it (0 until then, and 0 without --restart-s)")
    sim.add_argument("--no-stagger", action="store_true", help="turn checkpoint staggering off")
    sim.add_argument("--seed", type=int, default=0, help="seed of the failure injection")
    sim.add_argument("--until", type=finite, default=None, help="stop at this trace time (s)")
    sim.set_defaults(func=cmd_simulate)

    add_trace_commands(commands)
    add_job_commands(commands)
    add_fleet_commands(commands)
    add_dev_commands(commands)
    add_example_job_command(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    loopback_without_proxy()
    try:
        args = build_parser().parse_args(argv)
        return args.func(args)
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # The reader went away (`gpusched list | head`): stop quietly, as Unix tools do. Standard
        # output is pointed at /dev/null so that the interpreter's last flush does not fail too.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except KeyboardInterrupt:
        return 130


def console_main() -> None:
    """The `gpusched` command: `main`, then an exit that skips the interpreter's teardown. The
    Temporal client's runtime threads (Rust) can call into Python while it finalizes, which
    aborted about one exit in forty under load after a correct answer ("Fatal Python error:
    PyGILState_Release", exit 134 or 139; temporalio/sdk-python#300). Everything the command
    wrote is flushed first."""
    try:
        code = main()
    except SystemExit as e:  # argparse: --help (0), a flag it refuses (2)
        code = e.code
    if isinstance(code, str):
        print(code, file=sys.stderr)
        code = 1
    code = 0 if code is None else code
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BrokenPipeError:  # the reader went away after the command's last write
            code = code or 1
        except (OSError, ValueError):
            pass
    logging.shutdown()
    os._exit(code)


if __name__ == "__main__":
    console_main()
