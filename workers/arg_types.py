"""Argument types for the command line: argparse turns their errors into the usage line and exit
code 2, naming the flag, so a bad number never reaches the stack or a traceback."""

from __future__ import annotations

import argparse
import math
import time
from datetime import datetime, timezone
from pathlib import Path

from scheduler.errors import InputError
from scheduler.fleet import gpu_type_problem
from workflows.types import LATEST_EPOCH


def utf8_name(text: str) -> str:
    """A job id, team or cluster as typed: its bytes must be UTF-8, as every name the stack keeps
    is (a Latin-1 terminal's é reached the database and came back as its driver's error)."""
    try:
        text.encode()
    except UnicodeEncodeError:
        raise argparse.ArgumentTypeError(f"{text.encode(errors='surrogateescape')!r} holds bytes that are not "
                                         "UTF-8; type it in a UTF-8 locale") from None
    return text


def gpu_type(text: str) -> str:
    """A GPU type a machine reports: refused here rather than by every heartbeat after."""
    if (problem := gpu_type_problem(utf8_name(text))) is not None:
        raise argparse.ArgumentTypeError(f"{text[:40]!r}{'...' if len(text) > 40 else ''} {problem}")
    return text


_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def deadline(text: str) -> float:
    """A deadline hint as epoch seconds: `+90m`, `+6h`, `+2d`, `+3600s` from now, or an ISO date
    and time (local time unless it names a zone)."""
    spec = text.strip()
    if spec.startswith("+"):
        number, unit = spec[1:-1], spec[-1:].lower()
        try:
            amount = float(number) if unit in _UNITS else math.nan
        except ValueError:
            amount = math.nan
        if not math.isfinite(amount) or amount <= 0:
            raise argparse.ArgumentTypeError(f"{text!r} is not a time from now; write it as +90m, +6h or +2d")
        return _within_dates(text, time.time() + amount * _UNITS[unit])
    try:
        when = datetime.fromisoformat(spec)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither a date and time (2026-12-08T09:00) nor a time from "
                                         "now (+6h)") from None
    try:
        at = when.timestamp()  # a naive time is the local time, as typed
    except (OverflowError, OSError, ValueError):
        raise argparse.ArgumentTypeError(f"{text!r} is out of the range of dates a clock can tell") from None
    return _within_dates(text, at)


def _within_dates(text: str, at: float) -> float:
    """The deadline as the CLI's user typed it, refused in their words: the request's own check
    (epoch seconds within LATEST_EPOCH) speaks to an API caller."""
    if not 0 <= at <= LATEST_EPOCH:
        latest = datetime.fromtimestamp(LATEST_EPOCH, timezone.utc).date().isoformat()
        raise argparse.ArgumentTypeError(f"{text!r} is not between 1970-01-01 and {latest}; give a date and time "
                                         "(2026-12-08T09:00) or a time from now (+6h)")
    return at


def whole(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None


def count(text: str) -> int:
    """A whole number, 0 or more."""
    value = whole(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, not {value}")
    return value


def positive_int(text: str) -> int:
    """A whole number, 1 or more."""
    value = whole(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, not {value}")
    return value


def limit(text: str) -> int:
    """How many rows to show: 1 to a million."""
    value = positive_int(text)
    if value > 1_000_000:
        raise argparse.ArgumentTypeError(f"must be at most 1000000, not {value}")
    return value


def finite(text: str) -> float:
    """A finite number: inf and nan are no number of seconds, GPUs or failures."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, not {text}")
    return value


def positive_float(text: str) -> float:
    """A finite number above 0."""
    value = finite(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be above 0, not {text}")
    return value


MAX_INPUT_BYTES = 2**29  # a trace or fleet file bigger than this is not what it seems


def file_path(text: str) -> Path:
    """A file to write: not empty, and not a folder's name (`out/`), which Path would quietly take
    for the file `out`."""
    if not text.strip():
        raise argparse.ArgumentTypeError("is empty; give a file name")
    if text.endswith(("/", "\\")) or Path(text).is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a folder; give the name of a file (in it, say)")
    return Path(text)


def read_input(path: str | Path, what: str) -> str:
    """The text of an input file, or an ``InputError`` saying why it cannot be read: missing,
    unreadable, or not UTF-8 (with the line of the first bad byte)."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_INPUT_BYTES + 1)
    except OSError as e:
        raise InputError(str(path), None, None, f"cannot read the {what}: {e.strerror or e}") from None
    if len(raw) > MAX_INPUT_BYTES:  # /dev/zero, or a file of another kind: not read to the end
        raise InputError(str(path), None, None, f"the {what} is over {MAX_INPUT_BYTES // 2**20} MiB; "
                                                "is it the right file?")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise InputError(str(path), line, None, f"the {what} is not UTF-8 text (byte 0x{raw[e.start]:02x}); "
                                                "save it as UTF-8") from None


def same_file(a: str | Path, b: str | Path) -> bool:
    """Whether two paths name one file (the same path, or links to one); False if unsure."""
    try:
        return Path(a).resolve() == Path(b).resolve() or (Path(b).exists() and Path(a).samefile(b))
    except OSError:
        return False
