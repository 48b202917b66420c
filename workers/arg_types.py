"""Argument types for the command line: argparse turns their errors into the usage line and exit
code 2, naming the flag, so a bad number never reaches the stack or a traceback."""

from __future__ import annotations

import argparse


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


def positive_float(text: str) -> float:
    """A number above 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0:  # NaN too
        raise argparse.ArgumentTypeError(f"must be above 0, not {text}")
    return value
