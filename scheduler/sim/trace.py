"""The simulator's input: a trace of jobs, each with when it arrives and how much work it truly needs.

The CSV format is a contract (docs/traces.md, "Trace CSV"); this module reads and writes it without any
file I/O. One row is one job:

    job_id,submit_time,duration,num_gpus,team,priority,gpu_type,topology,checkpoint_interval,
    expected_duration,kind,deadline

Only ``job_id, submit_time, duration, num_gpus, team`` must be present as columns; every other
column may be missing or empty and then takes its default. Columns the contract does not name are
ignored, except two optional ones this reader understands: ``cluster`` (fills ``JobSpec.cluster``)
and ``gpu_memory_gb`` (fills ``JobSpec.gpu_memory_gb``). ``duration`` is the simulation's truth and
stays outside the ``JobSpec``, which is all the policy ever sees.
"""

from __future__ import annotations

import csv
import io
import math
import re
from collections.abc import Callable

from pydantic import BaseModel, ConfigDict, Field

from scheduler.errors import InputError
from scheduler.models import MIN_CHECKPOINT_INTERVAL, MOST_GPU_MEMORY_GB, JobKind, JobSpec, Priority, Topology

COLUMNS = (
    "job_id",
    "submit_time",
    "duration",
    "num_gpus",
    "team",
    "priority",
    "gpu_type",
    "topology",
    "checkpoint_interval",
    "expected_duration",
    "kind",
    "deadline",
)
"""The contract's columns, in the contract's order."""

REQUIRED_COLUMNS = ("job_id", "submit_time", "duration", "num_gpus", "team")
# What a trace's numbers may be: plain decimals (no `1_0`, no digits of other scripts), and no
# time beyond about ten years (a trace spans days; 1e308 s overflowed the report).
DECIMAL = re.compile(r"[+-]?((\d+\.?\d*|\.\d+)([eE][+-]?\d+)?|nan|inf|infinity)", re.IGNORECASE | re.ASCII)
WHOLE = re.compile(r"\d+", re.ASCII)
LONGEST_S = 3.2e8
TIME_BOUND = (LONGEST_S, "about ten years of seconds")  # a time column's (most, in words)
MOST_CHECKPOINTS = 1_000_000  # writes of one job: each is simulated and kept for the report
# And of the whole trace (a gigabyte or so of records): the Philly trace's four months have 340,000.
MOST_CHECKPOINTS_IN_TRACE = 2_000_000
# Jobs of one trace: each is kept (about 2 kB) until the trace is read whole, a bad last row
# included; 2,000,000 took 4 GB. The Philly trace's four months have 82,247.
MOST_TRACE_JOBS = 1_000_000
OPTIONAL_EXTRA_COLUMNS = ("cluster", "gpu_memory_gb")


class TraceJob(BaseModel):
    """One job of a trace: what the user asks for, when, and the work it really needs."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    spec: JobSpec
    submit_time: float = Field(ge=0)  # seconds from the trace start
    duration: float = Field(gt=0)  # seconds of running the job truly needs; unknown to the policy


# A judge of one parsed job: None, or (field, problem in words).
TraceCheck = Callable[[TraceJob], tuple[str, str] | None]


def parse_trace(text: str, source: str, check: TraceCheck | None = None) -> list[TraceJob]:
    """Read a trace CSV into jobs sorted by (submit_time, job_id).

    Defaults for empty cells: ``priority`` normal, ``kind`` training, ``gpu_type`` any (None),
    ``topology`` None (the core picks machine or block by size), ``checkpoint_interval`` empty or 0
    never checkpoints (None), ``deadline`` none, and ``expected_duration`` equal to ``duration`` —
    a trace without estimates is treated as one whose users estimate perfectly.

    Line numbers in errors are 1-based with the header as line 1. ``check``, if given, judges each
    job against what the trace alone cannot know (the fleet's clusters and teams): it returns the
    field and the problem, and the error names the row's line.
    """
    text = text.lstrip("\ufeff")
    reader = csv.reader(io.StringIO(text, newline=""))
    try:
        jobs = _read_rows(reader, source, check, text)
    except csv.Error as e:  # a lone carriage return in a cell, a cell over the csv module's limit
        raise InputError(source, max(1, reader.line_num), None, f"is not valid CSV ({e}); save it as plain CSV") from None
    jobs.sort(key=lambda j: (j.submit_time, j.spec.job_id))
    return jobs


def _read_rows(reader, source: str, check: TraceCheck | None, text: str) -> list[TraceJob]:
    header = _header(next(reader, None), source)
    jobs: list[TraceJob] = []
    first_line_of: dict[str, int] = {}
    checkpoints = 0.0  # the writes its jobs ask for, summed
    ended = reader.line_num  # the line the last record ended on
    for row in reader:
        began, ended = ended + 1, reader.line_num
        if not row or all(not cell.strip() for cell in row):
            continue  # blank lines carry no job
        line = reader.line_num
        spread = next((name for name, cell in zip(header, row) if "\n" in cell or "\r" in cell), None)
        if spread is not None or began != ended:
            if next(reader, None) is None and _ends_inside_a_quote(text):
                raise InputError(source, began, spread, (
                    f"opens a quote that is never closed: the rest of the file, to line {ended}, was read as "
                    "one value; close the quote on this line"))
            raise InputError(
                source, began, spread,
                f"a quoted value runs on to line {ended}; close the quote on its own line "
                "(a trace value never holds a line break)",
            )
        if len(jobs) == MOST_TRACE_JOBS:
            raise InputError(source, line, None, f"is job {MOST_TRACE_JOBS + 1:,} of the trace; a trace holds at most "
                                                 f"{MOST_TRACE_JOBS:,} jobs: split it, or shorten its span")
        if len(row) != len(header):
            raise InputError(
                source,
                line,
                None,
                f"has {len(row)} fields but the header has {len(header)}; "
                "every row needs one value per column (leave optional ones empty, e.g. `,,`)",
            )
        job = _RowReader(
            source, line, dict(zip(header, (cell.strip() for cell in row), strict=True))
        ).job()
        job_id = job.spec.job_id
        if job_id in first_line_of:
            raise InputError(
                source,
                line,
                "job_id",
                f"{job_id!r} is already used on line {first_line_of[job_id]}; every job needs its own id",
            )
        first_line_of[job_id] = line
        if job.spec.checkpoint_interval:
            checkpoints += job.duration / job.spec.checkpoint_interval
            if checkpoints > MOST_CHECKPOINTS_IN_TRACE:
                raise InputError(source, line, "checkpoint_interval", (
                    f"brings the trace to {checkpoints:,.0f} checkpoints (duration / checkpoint_interval, summed); "
                    f"a trace holds at most {MOST_CHECKPOINTS_IN_TRACE:,}: give its jobs longer intervals, or "
                    "split the trace"))
        problem = check(job) if check is not None else None
        if problem is not None:
            raise InputError(source, line, *problem)
        jobs.append(job)
    if not jobs:
        raise InputError(source, None, None, "the trace has a header but no jobs; add at least one row")
    return jobs


def checkpoints_in(jobs: list[TraceJob]) -> float:
    """The checkpoints a trace's jobs write, summed: each is simulated and kept for the report."""
    return sum(j.duration / j.spec.checkpoint_interval for j in jobs if j.spec.checkpoint_interval)


def _ends_inside_a_quote(text: str) -> bool:
    """Whether a quote is never closed, so that the rest of the file was read as one value. The
    lenient reader takes that silently; the strict one says so, where a quote inside an unquoted
    value (read as a plain character by both) does not trouble it."""
    try:
        for _ in csv.reader(io.StringIO(text, newline=""), strict=True):
            pass
    except csv.Error as e:
        return "unexpected end of data" in str(e)
    return False


def format_trace(jobs: list[TraceJob]) -> str:
    """The CSV text of ``jobs``, which ``parse_trace`` reads back to the same jobs.

    Writes the contract's columns, plus ``cluster`` and ``gpu_memory_gb`` only when some job sets
    them, so a plain trace stays exactly in the contract's shape.
    """
    columns = list(COLUMNS)
    extras = [c for c in OPTIONAL_EXTRA_COLUMNS if any(getattr(j.spec, c) is not None for j in jobs)]
    columns += extras
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(columns)
    for job in jobs:
        spec = job.spec
        cells = {
            "job_id": spec.job_id,
            "submit_time": _number(job.submit_time),
            "duration": _number(job.duration),
            "num_gpus": str(spec.num_gpus),
            "team": spec.team,
            "priority": spec.priority.value,
            "gpu_type": spec.gpu_type or "",
            "topology": spec.topology.value if spec.topology else "",
            "checkpoint_interval": _number(spec.checkpoint_interval) if spec.checkpoint_interval else "",
            "expected_duration": _number(spec.expected_duration),
            "kind": spec.kind.value,
            "deadline": _number(spec.deadline) if spec.deadline is not None else "",
            "cluster": spec.cluster or "",
            "gpu_memory_gb": _number(spec.gpu_memory_gb) if spec.gpu_memory_gb is not None else "",
        }
        writer.writerow([cells[c] for c in columns])
    return out.getvalue()


def _number(value: float) -> str:
    """Whole numbers without a trailing '.0'; anything else exactly (repr round-trips a float)."""
    if float(value).is_integer() and abs(value) < 1e15:
        return str(int(value))
    return repr(float(value))


def _header(row: list[str] | None, source: str) -> list[str]:
    if not row or all(not cell.strip() for cell in row):
        raise InputError(
            source,
            1,
            None,
            f"the first line is blank (or the file empty); the first line must be the header: {','.join(COLUMNS)}",
        )
    header = [cell.strip().lower() for cell in row]
    seen: set[str] = set()
    for name in header:
        if name and name in seen:
            raise InputError(
                source, 1, name, "appears twice in the header; keep one column of each name"
            )
        seen.add(name)
    missing = [c for c in REQUIRED_COLUMNS if c not in seen]
    if missing:
        raise InputError(
            source,
            1,
            ",".join(missing),
            f"the header lacks required column(s) {', '.join(missing)}; "
            f"the header must name at least {','.join(REQUIRED_COLUMNS)} (full order: {','.join(COLUMNS)})",
        )
    return header


class _RowReader:
    """Turns one row's cells into a TraceJob, blaming the exact column when a cell is wrong."""

    def __init__(self, source: str, line: int, cells: dict[str, str]):
        self.source = source
        self.line = line
        self.cells = cells

    def job(self) -> TraceJob:
        job_id = self.text("job_id")
        submit_time = self.to_the_millisecond("submit_time", self.number(
            "submit_time", minimum=0.0, hint="seconds from the trace start, 0 or more"
        ))
        duration = self.to_the_millisecond(
            "duration", self.number("duration", minimum=0.0, strict=True, hint="seconds of work, above 0"))
        expected = self.to_the_millisecond("expected_duration", self.optional_number(
            "expected_duration", minimum=0.0, strict=True, hint="seconds, above 0"
        ))
        interval = self.optional_number(
            "checkpoint_interval", minimum=0.0, hint="seconds, 0 or empty for never"
        )
        if interval is not None and 0 < interval < MIN_CHECKPOINT_INTERVAL:
            raise self.error("checkpoint_interval", f"must be 0 (never) or at least {MIN_CHECKPOINT_INTERVAL:g} "
                                                    f"second, got {self.cells['checkpoint_interval']!r}")
        interval = self.to_the_millisecond("checkpoint_interval", interval)
        if interval and duration / interval > MOST_CHECKPOINTS:
            raise self.error("checkpoint_interval", f"would have the job write {duration / interval:.3g} checkpoints "
                                                    f"over its {duration:g} s; give at least "
                                                    f"{duration / MOST_CHECKPOINTS:g} s")
        deadline = self.to_the_millisecond("deadline", self.optional_number(
            "deadline", minimum=0.0, hint="seconds from the trace start, 0 or more"
        ))
        memory = self.optional_number(
            "gpu_memory_gb", minimum=0.0, strict=True, hint="GB per GPU, above 0",
            most=(MOST_GPU_MEMORY_GB, "GB per GPU; no GPU holds more"),
        )
        spec = JobSpec(
            job_id=job_id,
            team=self.text("team"),
            num_gpus=self.gpu_count(),
            gpu_type=self.optional_text("gpu_type"),
            gpu_memory_gb=memory,
            topology=self.choice("topology", Topology, None),
            priority=self.choice("priority", Priority, Priority.normal),
            deadline=deadline,
            checkpoint_interval=interval or None,
            expected_duration=duration if expected is None else expected,
            kind=self.choice("kind", JobKind, JobKind.training),
            cluster=self.optional_text("cluster"),
        )
        return TraceJob(spec=spec, submit_time=submit_time, duration=duration)

    def text(self, column: str) -> str:
        value = self.cells[column]
        if not value:
            raise self.error(column, f"is empty; every job needs a {column}")
        if not value.isprintable():  # ASCII controls, and Unicode's (U+0085, U+2028, U+202E, ...)
            raise self.error(column, f"holds a control character ({value!r}); give plain text")
        return value

    def optional_text(self, column: str) -> str | None:
        return self.text(column) if self.cells.get(column) else None

    def gpu_count(self) -> int:
        value = self.cells["num_gpus"]
        count = int(value) if WHOLE.fullmatch(value) and len(value) < 10 else 0
        if count < 1:
            raise self.error("num_gpus", f"must be a whole number of GPUs, 1 or more, got {value!r}")
        return count

    def number(self, column: str, *, minimum: float, strict: bool = False, hint: str,
               most: tuple[float, str] = TIME_BOUND) -> float:
        value = self.cells[column]
        if not DECIMAL.fullmatch(value):
            raise self.error(column, f"must be a number ({hint}), got {value!r}")
        number = float(value)
        too_small = number <= minimum if strict else number < minimum
        if not math.isfinite(number) or too_small:
            raise self.error(column, f"must be {hint}, got {value!r}")
        if number > most[0]:
            raise self.error(column, f"must be at most {most[0]:.0f} ({most[1]}), got {value!r}")
        return number

    def to_the_millisecond(self, column: str, seconds: float | None) -> float | None:
        """A time kept to the millisecond, as allocations.csv and jobs.csv write times: a run of
        finer ones wrote files that could not reproduce its own summary. A duration that rounds
        to nothing is refused."""
        if seconds is None:
            return None
        kept = round(seconds, 3)
        if kept == 0 and seconds > 0 and column in ("duration", "expected_duration"):
            raise self.error(column, "must be at least 0.001 (times are kept to the millisecond), "
                                     f"got {self.cells[column]!r}")
        return kept

    def optional_number(
        self, column: str, *, minimum: float, strict: bool = False, hint: str,
        most: tuple[float, str] = TIME_BOUND,
    ) -> float | None:
        if not self.cells.get(column):
            return None
        return self.number(column, minimum=minimum, strict=strict, hint=hint, most=most)

    def choice(self, column: str, enum: type, default):
        value = self.cells.get(column, "")
        if not value:
            return default
        try:
            return enum(value.lower())
        except ValueError:
            allowed = " | ".join(member.value for member in enum)
            raise self.error(column, f"must be one of {allowed} (or empty), got {value!r}") from None

    def error(self, column: str, message: str) -> InputError:
        return InputError(self.source, self.line, column, message)
