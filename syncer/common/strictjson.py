"""JSON that every parser reads: no NaN, no Infinity (a leaf: stdlib only).

Python's `json` writes float('nan') as a bare `NaN` by default, which jq, JavaScript and most
other readers reject. Every record the project writes for others to read (metrics and events
lines, `--json` output, run summaries) goes through `dumps`, which writes a non-finite float as
null and refuses anything else that is not JSON.
"""

from __future__ import annotations

import json
import math
from typing import Any


def finite(value: Any) -> Any:
    """`value` with every non-finite float (in dicts, lists and tuples, recursively) as None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def dumps(value: Any, **kwargs: Any) -> str:
    """`json.dumps` of `finite(value)` with `allow_nan=False` (other json.dumps options pass through)."""
    return json.dumps(finite(value), allow_nan=False, **kwargs)
