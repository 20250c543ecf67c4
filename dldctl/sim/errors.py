"""The one exception of the simulation core (a leaf: imports nothing of the project).

The core raises ParamError for a parameter out of range and names the parameter's field, so the
CLI can turn it into a one-line usage error naming the matching flag.
"""

from __future__ import annotations


class ParamError(ValueError):
    """A parameter set is invalid: `field` is the offending field, `why` the rule it breaks."""

    def __init__(self, field: str, why: str) -> None:
        self.field = field
        self.why = why
        super().__init__(f"{field}: {why}")


def check(problems: list[tuple[str, str]]) -> None:
    """Raise ParamError for the first (field, why) problem, if any."""
    if problems:
        raise ParamError(*problems[0])
