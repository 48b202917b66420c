"""The one error type for bad user input: it names the file, line and field, and how to fix it."""

from __future__ import annotations


class InputError(Exception):
    """A malformed trace, fleet file or job spec. The CLI prints it and exits with code 2."""

    def __init__(self, source: str, line: int | None, field: str | None, message: str):
        self.source = source
        self.line = line
        self.field = field
        self.message = message
        super().__init__(str(self))

    def __str__(self) -> str:
        where = self.source if self.line is None else f"{self.source}:{self.line}"
        what = f" field '{self.field}':" if self.field else ""
        return f"{where}:{what} {self.message}"
