"""Every scenario's results against their committed digests: a refactor changes no result.

Each scenario of scenarios/ and each arm of every expressible case of scenarios/validation/ is run and written as
`expertsim run -o` writes it; summary.json (with this checkout's path as <repo>) and the content of every Parquet
file (column by column: names, types and values, so that a Parquet writer's own metadata does not count) are
hashed and compared with tests/golden/outputs.json (the summary without its cost figures, COST_KEYS). A change
that moves a result on purpose regenerates the file and says why in its commit:

    python -m tests.test_outputs_unchanged --write
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = Path(__file__).with_name("golden") / "outputs.json"


def table_digest(path: Path) -> str:
    """sha256 of a Parquet file's columns: each one's name, its values' type and its values."""
    table = pq.read_table(path)
    digest = hashlib.sha256()
    for name, column in zip(table.column_names, table.columns):
        column = column.combine_chunks()
        if pa.types.is_dictionary(column.type):
            column = column.dictionary_decode()
        if pa.types.is_list(column.type) or pa.types.is_fixed_size_list(column.type):
            digest.update(f"{name}:list:".encode())
            column = column.flatten()
        if pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
            digest.update(f"{name}:text:".encode())
            digest.update("\x1f".join("\x00" if v is None else v for v in column.to_pylist()).encode())
        else:
            values = column.to_numpy(zero_copy_only=False)
            digest.update(f"{name}:{values.dtype.str}:".encode())
            digest.update(np.ascontiguousarray(values).tobytes())
        digest.update(f"|{len(column)}|".encode())
    return digest.hexdigest()


# What the simulator spent, not what it found: speed work changes these on purpose (issue 33's short cuts save
# events), so the summary is compared without them.
COST_KEYS = ("simulated_events",)


def folder_digests(folder: Path) -> dict[str, str]:
    out = {}
    for file in sorted(folder.iterdir()):
        if file.suffix == ".parquet":
            out[file.name] = table_digest(file)
            continue
        text = file.read_text().replace(str(ROOT), "<repo>")
        if file.name == "summary.json":
            summary = json.loads(text)
            for key in COST_KEYS:
                summary.pop(key, None)
            text = json.dumps(summary, sort_keys=True)
        out[file.name] = hashlib.sha256(text.encode()).hexdigest()
    return out


def runs(group: str) -> list[tuple[str, object]]:
    """The runs of a scenario file or a validation case (none for a case that is not expressible): (name, a
    function that loads its scenario)."""
    from sim.explore.runner import load_scenario_data, make_point
    from sim.explore.validate import base_of, load_cases
    from sim.scenario import load_scenario, scenario_hash

    path = ROOT / "scenarios" / f"{group}.toml"
    if path.is_file():
        return [(group, lambda: load_scenario(path))]
    [(path, case)] = load_cases([group])
    if case.not_expressible is not None:
        return []
    where, data = base_of(path, case)
    base_hash = scenario_hash(load_scenario(where, data))

    def arm_scenario(overrides: dict):
        point = make_point(where, data, overrides, base_hash)
        assert point.error is None, point.error
        return load_scenario_data(point.scenario_path, point.data)

    return [(f"{case.id}--{arm.name}", lambda arm=arm: arm_scenario(arm.set)) for arm in case.arms]


def digests_of(group: list, folder: Path) -> dict[str, dict[str, str]]:
    from sim.results import write_results
    from sim.simulate import run_scenario

    found = {}
    for name, scenario in group:
        write_results(run_scenario(scenario()), folder / name)
        found[name] = folder_digests(folder / name)
    return found


GROUPS = sorted({path.stem for path in (ROOT / "scenarios").glob("*.toml")}
                | {path.stem for path in (ROOT / "scenarios" / "validation").glob("*.toml")})


@pytest.mark.parametrize("group", GROUPS)
def test_outputs_match_their_committed_digests(group, tmp_path):
    golden = json.loads(GOLDEN.read_text())
    found = digests_of(runs(group), tmp_path)
    expected = {name: digests for name, digests in golden.items() if name == group or name.startswith(group + "--")}
    assert set(found) == set(expected), "runs added or gone: regenerate tests/golden/outputs.json and say why"
    changed = {name: [f for f in digests if expected[name].get(f) != digests[f]] for name, digests in found.items()}
    assert not any(changed.values()), f"results changed: {changed}"


def write_golden() -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        found = {}
        for group in GROUPS:
            found.update(digests_of(runs(group), Path(folder)))
    GOLDEN.write_text(json.dumps(found, indent=1, sort_keys=True) + "\n")
    print(f"{len(found)} runs written to {GOLDEN}")


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit(__doc__)
    write_golden()
