"""`gpusched trace …`: make simulator traces (and fleets to run them on) from the command line.

The pure work lives in ``scheduler.sim.workloads``; this module only reads and writes files and
turns bad input into one line on stderr with exit code 2.

    gpusched trace generate --out T.csv [--jobs N] [--days D] [--gpus G] [--load L] [--seed S]
                            [--inference-fraction F] [--fleet-out F.yaml]
    gpusched trace from-philly --input philly.csv --out T.csv [--start "YYYY-mm-dd HH:MM:SS"]
                               [--days D] [--seed S] [--fleet-out F.yaml] [--load L]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import sys
from pathlib import Path

from scheduler.errors import InputError
from scheduler.fleet import parse_fleet
from scheduler.sim.trace import MOST_CHECKPOINTS_IN_TRACE, TraceJob, checkpoints_in, format_trace
from scheduler.sim.workloads import (
    DAY,
    PHILLY_BUSIEST_WEEK,
    MAX_GENERATED_DAYS,
    MAX_LOAD,
    MIN_LOAD,
    fleet_for,
    from_philly,
    generate_trace,
    offered_gpu_seconds,
)
from workers.arg_types import file_path, finite, positive_float, read_input, same_file


def add_trace_commands(subparsers) -> None:
    """Add ``trace generate`` and ``trace from-philly`` to a top-level argparse subparsers object."""
    trace = subparsers.add_parser(
        "trace", help="make simulator traces: synthetic or from the Philly trace"
    )
    commands = trace.add_subparsers(
        dest="trace_command", required=True, metavar="{generate,from-philly}"
    )

    generate = commands.add_parser(
        "generate", help="write a synthetic seed-scale trace (mix in docs/traces.md)"
    )
    generate.add_argument("--out", required=True, type=file_path, help="trace CSV to write")
    generate.add_argument("--jobs", type=int, default=3000, help="number of jobs (default 3000)")
    generate.add_argument("--days", type=finite, default=3.0, help="arrival window in days (default 3)")
    generate.add_argument(
        "--gpus", type=int, default=5120, help="GPUs the load is measured against (default 5120)"
    )
    generate.add_argument(
        "--load", type=finite, default=1.2, help="offered GPU-seconds / capacity (default 1.2)"
    )
    generate.add_argument("--seed", type=int, default=1, help="random seed (default 1)")
    generate.add_argument(
        "--inference-fraction", type=finite, default=0.0, help="share of inference jobs (default 0)"
    )
    generate.add_argument("--fleet-out", type=file_path, help="also write a fleet YAML sized for --load")
    generate.set_defaults(func=run_generate)

    philly = commands.add_parser(
        "from-philly", help="convert the Microsoft Philly trace CSV to a gpusched trace"
    )
    philly.add_argument(
        "--input", required=True, type=Path, help="your copy of philly.csv (see docs/traces.md)"
    )
    philly.add_argument("--out", required=True, type=file_path, help="trace CSV to write")
    philly.add_argument(
        "--start", default=PHILLY_BUSIEST_WEEK, help=f"window start (default {PHILLY_BUSIEST_WEEK!r})"
    )
    philly.add_argument("--days", type=positive_float, default=7.0, help="window length in days (default 7)")
    philly.add_argument(
        "--seed", type=int, default=1, help="seed for priorities and estimate errors (default 1)"
    )
    philly.add_argument("--fleet-out", type=file_path, help="also write a fleet YAML sized for --load")
    philly.add_argument(
        "--load", type=positive_float, default=1.1, help="offered load the fleet is sized for (default 1.1)"
    )
    philly.set_defaults(func=run_from_philly)


def run_generate(args: argparse.Namespace) -> int:
    def make() -> tuple[list[TraceJob], int | None]:
        jobs = generate_trace(
            jobs=args.jobs,
            days=args.days,
            gpus=args.gpus,
            load=args.load,
            seed=args.seed,
            inference_fraction=args.inference_fraction,
        )
        return jobs, args.gpus

    command = (
        f"gpusched trace generate --jobs {args.jobs} --days {args.days} --gpus {args.gpus} "
        f"--load {args.load} --seed {args.seed} --inference-fraction {args.inference_fraction} "
        f"--out {shlex.quote(str(args.out))} --fleet-out {shlex.quote(str(args.fleet_out))}"
    )
    return _write(args, make, command, smaller="--gpus, --jobs, --days", fewer="--jobs or --days")


def run_from_philly(args: argparse.Namespace) -> int:
    def make() -> tuple[list[TraceJob], int | None]:
        if not 0 < args.days <= MAX_GENERATED_DAYS:
            raise InputError("--days", None, None, f"must be above 0 and at most {MAX_GENERATED_DAYS}, got {args.days:g}")
        if same_file(args.input, args.out):
            raise InputError("--out", None, None, f"is the input {args.input}: it would be overwritten; "
                                                  "write the trace to another file")
        if args.fleet_out is not None and same_file(args.input, args.fleet_out):
            raise InputError("--fleet-out", None, None, f"is the input {args.input}: it would be overwritten; "
                                                        "write the fleet to another file")
        text = read_input(args.input, "Philly trace")
        jobs = from_philly(text, str(args.input), start=args.start, days=args.days, seed=args.seed)
        if not jobs:
            raise InputError(
                str(args.input),
                None,
                None,
                f"has no jobs in the {args.days}-day window from {args.start}; pick another --start",
            )
        return jobs, None

    command = (
        f"gpusched trace from-philly --input {shlex.quote(str(args.input))} --start {shlex.quote(args.start)} "
        f"--days {args.days} --seed {args.seed} --out {shlex.quote(str(args.out))} "
        f"--fleet-out {shlex.quote(str(args.fleet_out))} --load {args.load}"
    )
    # A window's fleet is made smaller only by its length, and its checkpoints fewer by a shorter one.
    return _write(args, make, command, smaller="a longer --days", fewer="--days")


def _write(args: argparse.Namespace, make, command: str, smaller: str, fewer: str) -> int:
    """Build the trace, write it (and the fleet), print the summary; bad input exits 2. `smaller`:
    the flags that make the workload smaller, named when its fleet would be too big; `fewer`: the
    flags that make it fewer checkpoints, named when it has more than a simulation takes."""
    if args.fleet_out is not None and not MIN_LOAD <= args.load <= MAX_LOAD:
        print(f"error: --load: must be between {MIN_LOAD:g} and {MAX_LOAD:g} to size a fleet, got {args.load:g}",
              file=sys.stderr)
        return 2
    span = args.days * DAY
    if args.fleet_out is not None and same_file(args.out, args.fleet_out):
        print(f"error: --fleet-out: is --out ({args.out}): give the fleet a file of its own", file=sys.stderr)
        return 2
    writing = args.out  # the file a failed write names: a full disk raises no filename
    try:
        jobs, gpus = make()
        checkpoints = checkpoints_in(jobs)
        if checkpoints > MOST_CHECKPOINTS_IN_TRACE:  # simulate would refuse the file written
            raise InputError(fewer, None, None, (
                f"the trace would hold {checkpoints:,.0f} checkpoints (duration / checkpoint_interval, summed), "
                f"more than the {MOST_CHECKPOINTS_IN_TRACE:,} gpusched simulate takes; give a smaller {fewer}"))
        files = [(args.out, format_trace(jobs))]
        if args.fleet_out is not None:
            fleet, gpus = _sized_fleet(jobs, args.load, span, f"Made by: {command}", smaller)
            files.append((args.fleet_out, fleet))
        _write_all(files)
    except InputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"error: {exc.filename or writing}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    work = offered_gpu_seconds(jobs)
    on_fleet = f", load {work / (gpus * span):.2f} on {gpus} GPUs" if gpus else ""
    # On standard error, as simulate's lines: --out may be /dev/stdout, and the trace is the output.
    print(
        f"wrote {args.out}: {len(jobs)} jobs over {args.days:g} days, {work:,.0f} GPU-seconds offered{on_fleet}",
        file=sys.stderr,
    )
    return 0


def _write_all(files: list[tuple[Path, str]]) -> None:
    """Write each (path, text) so that a write that fails leaves every file as it was: a regular
    file (or a new one) through a temporary file beside it, renamed over it once all are
    written; a device (--out /dev/stdout) in place, before any rename. An OSError names its file."""
    staged: list[tuple[Path, Path]] = []
    try:
        for path, text in sorted(files, key=lambda f: _in_place(f[0]), reverse=True):
            try:
                if _in_place(path):
                    with open(path, "w", encoding="utf-8") as handle:
                        handle.write(text)
                    continue
                target = path.resolve() if path.is_symlink() else path  # written through the link
                temporary = target.with_name(f".{target.name}.{os.getpid()}.partial")
                staged.append((temporary, target))
                with open(temporary, "w", encoding="utf-8") as handle:
                    handle.write(text)
            except OSError as exc:
                exc.filename = str(path)  # the file asked for, not the temporary one
                raise
        for temporary, path in staged:
            try:
                os.replace(temporary, path)
            except OSError as exc:
                exc.filename = str(path)
                raise
        staged.clear()
    finally:
        for temporary, _ in staged:
            # Its folder may be a file or gone: that error is the one already raised, named for the user.
            with contextlib.suppress(OSError):
                temporary.unlink(missing_ok=True)


def _in_place(path: Path) -> bool:
    """Whether a file is written in place: a device or pipe, not a regular file or a new one."""
    try:
        return path.exists() and not path.is_file()
    except OSError:
        return False


def _sized_fleet(jobs: list, load: float, span: float, comment: str, smaller: str) -> tuple[str, int]:
    """The fleet YAML sized for `load`, and its GPUs."""
    try:
        fleet = fleet_for(jobs, load=load, span=span, comment=comment)
        return fleet, parse_fleet(fleet, "generated fleet").total_gpus
    except InputError as exc:  # it names a line of a file never written, and racks nobody gave
        raise InputError("--fleet-out", None, None, (
            f"the fleet this trace needs at this --load is more than a fleet file holds ({exc.message}); "
            f"give a higher --load, or a smaller workload ({smaller})")) from None
