"""The notebook API: one call runs a scenario and gives back tables, not files (docs/notebook.md).

    import sim
    run = sim.run("scenarios/ds4-504-per-class.toml", {"engine.flags.ssd-streaming-cache-experts": 4096})
    run.summary      # DataFrame: the headline metrics (metric, value, shown with its unit)
    run.steps        # DataFrame: one row per engine step (a layer of a decode token or of a prefill chunk)
    run.links        # DataFrame: every busy interval of every resource of the machine
    run.record       # dict: what summary.json holds, provenance included
    run.save("out/") # the files `expertsim run -o out/` writes
    run              # in Jupyter: the headline table, the engine's notices and out-of-domain warnings

Settings are `expertsim run --set` keys (sweep's --grid spelling); the same parsing serves both, so a
setting a notebook accepts is one the command line accepts, and the record's provenance lists them.
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from pathlib import Path

import pandas as pd


def _spelled(value) -> str:
    """A Python value as `--set` spells it: booleans as TOML's true/false, lists comma-separated."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return ",".join(_spelled(v) for v in value)
    return str(value)


@dataclass
class Run:
    """A finished run of a scenario. `record` is the run's summary.json; the frames are the run's own."""

    record: dict
    steps: pd.DataFrame
    requests: pd.DataFrame
    copies: pd.DataFrame
    links: pd.DataFrame
    _result: object  # sim.results.RunResult: what `save` writes

    @property
    def summary(self) -> pd.DataFrame:
        """The headline metrics (sim.explore.runner.METRICS, or the engine's own headline) this run has, in order."""
        from sim.explore.report import with_unit

        keys = self._headline_keys()
        return pd.DataFrame({"metric": keys, "value": pd.Series([self.record[k] for k in keys], dtype=object),
                             "shown": [with_unit(k, self.record[k]) for k in keys]})

    @property
    def notices(self) -> list[str]:
        """What the engine said about the settings (a capped cache, a disabled cache, a full context...)."""
        return list(self.record.get("notices", []))

    @property
    def out_of_domain(self) -> list[str]:
        """Calibration records used outside the engine, model or hardware they were fitted on."""
        return list(self.record.get("out_of_domain", []))

    def save(self, folder: str | Path, force: bool = False) -> dict:
        """Write the run's files into `folder` (a new or empty folder, or any with `force`): summary.json,
        steps.parquet, ... as `expertsim run -o` does. Returns the paths written."""
        from sim.results import write_results
        from sim.outputs import claim_folder

        claim_folder(Path(folder), force, "folder", force_as="force=True")
        self.record["files"] = write_results(self._result, folder)
        return self.record["files"]

    def _headline_keys(self) -> list[str]:
        from sim.engines import ENGINES
        from sim.explore.runner import METRICS

        keys = ENGINES[self.record["engine"]].headline or METRICS
        return [k for k in keys if k in self.record]

    def _repr_html_(self) -> str:
        r = self.record
        title = f"{r['engine']} {r['variant']} on {r['hardware']}, {r['model']}"
        rows = "".join(f"<tr><td>{html.escape(m)}</td><td style='text-align:right'>{html.escape(s)}</td></tr>"
                       for m, s in zip(self.summary["metric"], self.summary["shown"]))
        said = [("engine", n) for n in self.notices] + [("out of domain", w) for w in self.out_of_domain]
        notes = "".join(f"<li><b>{who}</b>: {html.escape(text)}</li>" for who, text in said)
        return (f"<div><b>{html.escape(title)}</b><table>{rows}</table>"
                + (f"<ul>{notes}</ul>" if notes else "") + "</div>")


def run(scenario: str | Path, settings: dict | None = None) -> Run:
    """Run the scenario file with `settings` (dotted key -> value, as `expertsim run --set KEY=VALUE`)
    changed for this run. Bad input raises sim.errors.InputError with the one line the CLI prints."""
    from sim.simulate import run_scenario
    from sim.results import link_frame
    from sim.explore.sweep import parse_settings
    from sim.scenario import load_scenario

    specs = [f"{key}={_spelled(value)}" for key, value in (settings or {}).items()]
    data, overrides = parse_settings(scenario, specs) if specs else (None, {})
    result = run_scenario(load_scenario(scenario, data))
    if overrides:
        result.summary["provenance"]["settings"] = overrides  # the scenario hash covers them too
    return Run(result.summary, result.steps, result.timings, result.copies, link_frame(result.links), result)
