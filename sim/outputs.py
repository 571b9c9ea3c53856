"""What expertsim writes for a user: strict JSON, and files that are never replaced without --force.

A rate with nothing to count (a hit rate of a phase with no lookups) is NaN inside the simulator; in JSON it is
`null`, because `NaN` is not JSON and jq, browsers and strict parsers reject it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from sim.errors import InputError


def strict(value):
    """`value` with NaN and infinities as None and numpy scalars and arrays as Python ones, recursively."""
    if isinstance(value, dict):
        return {str(k): strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict(v) for v in value]
    if isinstance(value, np.ndarray):
        return [strict(v) for v in value.tolist()]
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def dumps(value, **kwargs) -> str:
    """JSON that any strict parser reads (allow_nan=False after `strict`)."""
    return json.dumps(strict(value), allow_nan=False, **kwargs)


def claim_file(path: str | Path, force: bool, field: str) -> Path:
    """The path of a file about to be written: refused if something is already there and --force is not given."""
    path = Path(path)
    if path.is_dir():
        raise InputError(str(path), field, str(path), "is a folder; give a file name")
    if path.exists() and not force:
        raise InputError(str(path), field, str(path), "exists; add --force to replace it")
    return path


def claim_folder(path: str | Path, force: bool, field: str, force_as: str = "--force") -> Path:
    """A results folder about to be written: refused if it is a file, or holds anything and `force` is not given
    (a user's files, or another run's or sweep's results, would be mixed with this one's). `force_as`: how the
    caller spells it, the option or the Python API's argument."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise InputError(str(path), field, str(path), "is a file, not a folder")
    if path.is_dir() and any(path.iterdir()) and not force:
        raise InputError(str(path), field, str(path), f"is not empty; add {force_as} to write into it")
    return path
