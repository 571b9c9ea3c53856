"""Shared test helpers."""

import os
import tomllib
from pathlib import Path

import pytest
import tomli_w


def require(module: str, reason: str):
    """Import MODULE, or skip the calling test module saying REASON; under CI (which installs every extra) a
    missing module fails instead, so a test that CI is meant to run can never silently stop running."""
    try:
        return pytest.importorskip(module, reason=reason)
    except pytest.skip.Exception:
        if os.environ.get("CI"):
            pytest.fail(f"CI is set but {module} is missing: {reason}", pytrace=False)
        raise


def profile_with(tmp_path: Path, base: str, name: str, changes: dict) -> Path:
    """A copy of scenarios/hardware/BASE.toml named NAME with some figures changed, written under tmp_path.
    `changes` maps a dotted key ("host.ram_gib") to a value or to a function of the old value; a table of
    points (the SSD's) gets it applied to every point. The calibration file reference is dropped, and so is a
    changed figure's `range` (the range of the measured figure, which a changed value need not lie in)."""
    data = tomllib.loads((Path(__file__).resolve().parents[1] / "scenarios" / "hardware" / f"{base}.toml").read_text())
    data.pop("calibration", None)
    data["name"] = name
    for dotted, value in changes.items():
        *tables, leaf = dotted.split(".")
        table = data
        for key in tables:
            table = table[key]
        for quantity in table[leaf] if isinstance(table[leaf], list) else [table[leaf]]:
            quantity["value"] = value(quantity["value"]) if callable(value) else value
            quantity.pop("range", None)
            quantity.pop("range_source", None)
    path = tmp_path / f"{name}.toml"
    path.write_text(tomli_w.dumps(data))
    return path
