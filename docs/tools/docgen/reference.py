"""Generated regions: reference material read from the code, and tables read from the exhibits' JSON.

Why generated into the committed pages rather than at build time by a mkdocs hook: the pages then read
the same in a plain markdown viewer as on the site, a change to the CLI or the schema shows up as a diff
of the page in the same commit, and the strict site build needs nothing but mkdocs. The docs test
regenerates every region and fails when a page holds a stale one.
"""

from __future__ import annotations

import inspect
import json
import re
import types
import typing

from docgen.pages import FIGURES, ROOT

from sim.schema import field_comments


def _cell(text: object) -> str:
    """A table cell: pipes escaped; angle brackets escaped outside code spans (else they read as HTML)."""
    parts = str(text).replace("|", "\\|").replace("\n", " ").split("`")
    for i in range(0, len(parts), 2):
        parts[i] = re.sub(r"<(?=[A-Za-z/!?])", "&lt;", parts[i])
    return "`".join(parts)


def table(header: list[str], rows: list[list[object]], align: str = "") -> str:
    """A markdown table; align holds one character per column, "r" for right-aligned, else left."""
    marks = ["---:" if (align[i:i + 1] == "r") else "---" for i in range(len(header))]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(marks) + "|"]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def exhibit(name: str) -> dict:
    return json.loads((FIGURES / f"{name}.json").read_text())


# ------------------------------------------------------------------------------------------ CLI


def cli() -> str:
    """Every command of `expertsim` as its --help shows it: usage, what it does, each option."""
    import typer

    from sim.cli import app

    root = typer.main.get_command(app)
    out = []

    def visit(command, path: str) -> None:
        ctx = command.context_class(command, info_name=path)
        subcommands = getattr(command, "commands", None)
        if subcommands and path != "expertsim":
            out.append(f"### `{path}`\n\n{command.help}\n")
        if not subcommands:
            usage = command.get_usage(ctx).replace("Usage: ", "")
            out.append(f"### `{path}`\n\n{command.help}\n\n    {usage}\n")
            rows = []
            for param in command.get_params(ctx):
                record = param.get_help_record(ctx)
                if record is None or record[0] == "--help":
                    continue
                rows.append([f"`{record[0]}`", record[1]])
            if rows:
                out.append(table(["argument or option", "meaning [default]"], rows))
        for name in sorted(subcommands or {}):
            visit(subcommands[name], f"{path} {name}")

    visit(root, "expertsim")
    return "\n".join(out)


# ------------------------------------------------------------------------------------------ schemas


def _constraints(metadata: list) -> list[str]:
    words = {"ge": "≥", "gt": ">", "le": "≤", "lt": "<", "min_length": "min length", "max_length": "max length",
             "pattern": "matches"}
    out = []
    for item in metadata:
        for attr, word in words.items():
            value = getattr(item, attr, None)
            if isinstance(value, int) and value > 2**32 and value & (value - 1) == 0:
                value = f"2^{value.bit_length() - 1}"  # a bound like 2**63 reads better as a power
            if value is not None:
                out.append(f"{word} `{value}`" if attr == "pattern" else f"{word} {value}")
    return out


def _type_text(annotation, links: dict) -> tuple[str, bool]:
    """(readable type, optional?) of an annotation."""
    from pydantic import BaseModel

    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        base, *meta = typing.get_args(annotation)
        text, optional = _type_text(base, links)
        extra = _constraints(meta)
        if any(type(m).__name__ in ("PlainValidator", "BeforeValidator") for m in meta):
            extra.append("checked as the engine parses it")
        return (f"{text} ({', '.join(extra)})" if extra else text), optional
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        parts = [_type_text(a, links)[0] for a in args]
        return " or ".join(dict.fromkeys(parts)), len(args) < len(typing.get_args(annotation))
    if origin is typing.Literal:
        return " | ".join(f'`"{a}"`' for a in typing.get_args(annotation)), False
    if origin is list:
        return f"array of {_type_text(typing.get_args(annotation)[0], links)[0]}", False
    if origin is dict:
        return f"table of {_type_text(typing.get_args(annotation)[1], links)[0]}", False
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return links.get(annotation, f"table `{annotation.__name__}`"), False
    names = {str: "string", int: "integer", float: "number", bool: "boolean"}
    return names.get(annotation, getattr(annotation, "__name__", str(annotation))), False


def _default(info) -> str:
    from pydantic_core import PydanticUndefined

    if info.is_required():
        return "required"
    if info.default_factory is not None:
        return "empty table"
    if info.default is None or info.default is PydanticUndefined:
        return "unset"
    value = info.default
    return f"`{json.dumps(value)}`"


def model_table(model: type, links: dict) -> str:
    comments = {}
    for klass in reversed(model.__mro__):  # a subclass's comments win
        if isinstance(klass, type) and hasattr(klass, "model_fields"):
            comments.update(field_comments(klass))
    rows = []
    for name, info in model.model_fields.items():
        text, optional = _type_text(info.annotation, links)
        extra = _constraints(info.metadata)
        if extra:
            text += f" ({', '.join(extra)})"
        rows.append([f"`{info.alias or name}`", text, _default(info), comments.get(name, "")])
    return table(["key", "type", "default", "what it is (from the code's comments)"], rows)


def scenario_schema() -> str:
    from sim import scenario as sc
    from sim.engines import ENGINES

    engines = [engine.Settings for engine in ENGINES.values()]
    links = {sc.TraceSource: "table `[trace]`", sc.Workload: "table `[workload]`",
             sc.Request: "table `[[workload.requests]]`"}
    for engine in engines:
        links[engine] = "table `[engine]`"
        for section in ("flags", "env"):
            if section in engine.model_fields:
                links[engine.model_fields[section].annotation] = f"table `[engine.{section}]` (below)"
    parts = ["### Top level\n\n", model_table(sc.Scenario, links)]
    for spec, engine in zip(ENGINES.values(), engines):
        name = spec.name
        only_in, refused = spec.only_in, spec.not_modelled  # knobs of some variants only; knobs refused
        parts += [f"\n### `[engine]` with `name = \"{name}\"`\n\n"]
        if engine.__doc__:
            parts.append(f"{inspect.cleandoc(engine.__doc__)}\n\n")
        parts.append(model_table(engine, links))
        flags = engine.model_fields["flags"].annotation
        parts.append(f"\n#### `[engine.flags]` for {name}\n\n")
        if flags.__doc__:
            parts.append(f"{inspect.cleandoc(flags.__doc__)}\n\n")
        parts.append(model_table(flags, links))
        if "env" in engine.model_fields:
            names = []
            for env_name in engine.model_fields["env"].annotation.model_fields:
                note = ""
                if env_name in only_in:
                    note = f" (variant {' or '.join(only_in[env_name])} only)"
                if env_name in refused:
                    note = f" (refused: {refused[env_name]} is not modelled)"
                names.append(f"`{env_name}`{note}")
            parts.append(f"\n#### `[engine.env]` for {name}\n\nStrings, kept as typed (the engine model parses "
                         f"them as the engine does). Known names: {', '.join(names)}.\n")
    parts += ["\n### `[trace]`\n\n", model_table(sc.TraceSource, links),
              "\n### `[[workload.requests]]`\n\n", model_table(sc.Request, links)]
    return "".join(parts)


def hardware_schema() -> str:
    from sim import hardware as hw

    links = {hw.Gpu: "table `[gpu]`", hw.Host: "table `[host]`", hw.Pcie: "table `[pcie]`", hw.Ssd: "table `[ssd]`",
             hw.D2d: "table `[d2d]`", hw.Latency: "table `[latency]`", hw.Compute: "table `[compute.\"CLASS\"]`"}
    for model in (hw.GBps, hw.Micros, hw.MicrosPerGiB, hw.GiBs, hw.KiBs, hw.SsdPoint):
        unit = typing.get_args(model.model_fields["unit"].annotation)[0]
        extra = ", queue_depth" if "queue_depth" in model.model_fields else ""
        links[model] = f"quantity in {unit}{extra}"
    parts = ["### Top level\n\n", model_table(hw.HardwareProfile, links)]
    for section, model in (("gpu", hw.Gpu), ("host", hw.Host), ("pcie", hw.Pcie), ("ssd", hw.Ssd), ("d2d", hw.D2d),
                           ("latency", hw.Latency), ('compute."CLASS"', hw.Compute)):
        parts += [f"\n### `[{section}]`\n\n", model_table(model, links)]
    parts += ["\n### A quantity\n\nEvery number above is a table of its own:\n\n", model_table(hw.Quantity, links)]
    return "".join(parts)


def seed_scenarios() -> str:
    """The committed scenarios with the first line of their `# Scenario:` header and their engine."""
    from sim.schema import read_toml

    rows = []
    for path in sorted((ROOT / "scenarios").glob("*.toml")):
        header = next((line for line in path.read_text().splitlines() if line.startswith("# Scenario:")), "")
        data = read_toml(path, str(path))
        engine = data.get("engine", {})
        rows.append([f"`{path.name}`", f"{engine.get('name', '')} {engine.get('variant', '')}".strip(),
                     data.get("hardware", ""), header.removeprefix("# Scenario:").strip()])
    return table(["file", "engine", "hardware", "what it is (its header)"], rows)


# ------------------------------------------------------------------------------------------ calibration file


def calibration_file() -> str:
    """The calibration file's keys as sim/calibrate/fileformat.py documents them, and the keys and types the
    committed files hold."""
    from sim.calibrate import fileformat

    doc = inspect.getdoc(fileformat).split("\n\n", 1)[1]
    rows: list[list[str]] = []
    for line in doc.splitlines():
        if not line.strip():
            break
        if line.startswith("    ") and not line[4:5].isspace():
            found = re.match(r"([\w-]+(?:, [\w-]+)*)\s*(.*)", line.strip())  # "key[, key...]   meaning"
            key, meaning = found[1], found[2]
            keys = ", ".join(f"`{k.strip()}`" for k in key.split(","))
            rows.append([keys, meaning.strip() or "as named"])
        elif rows:
            rows[-1][1] += " " + line.strip()
    parts = [f"Schema `{fileformat.SCHEMA}`, version {fileformat.SCHEMA_VERSION}.\n\n",
             table(["key", "what it holds"], rows)]
    folder = ROOT / "scenarios" / "hardware" / "calibration"
    files = sorted(p for p in folder.glob("*.json") if json.loads(p.read_text()).get("schema") == fileformat.SCHEMA)
    present = []
    for path in files:
        record = json.loads(path.read_text())
        present.append([f"`{path.name}`", record["status"], record["gpu"]["name"],
                        ", ".join(f"`{k}`" for k in record)])
    parts += ["\nThe committed calibration files and the keys each holds:\n\n",
              table(["file", "status", "GPU", "keys"], present)]
    return "".join(parts)


# ------------------------------------------------------------------------------------------ tables from exhibits


def _figure_text(value, kind: str) -> str:
    if value is None:
        return ""
    if kind == "percent":
        return f"{value:.1f} %"
    return f"{value:,.3g}" if abs(value) < 10 else f"{value:,.0f}" if abs(value) >= 1000 else f"{value:,.1f}"


def validation_table() -> str:
    """The validation record as `expertsim validate` prints it: a ratio row's effects side by side, its error in
    points of effect (sim.explore.validate.judge_effect)."""
    from sim.explore.validate import effect_text, error_text, verdict_text

    rows = []
    for r in exhibit("validation-cases")["data"]["rows"]:
        if r["metric"] is None:
            rows.append([f"`{r['case']}`", r["role"], r["note"], "", "", "", "", "", "", r["source"], ""])
            continue
        measured = _figure_text(r["measured_low"], r["kind"])
        if r["measured_high"] != r["measured_low"]:
            measured += f"–{_figure_text(r['measured_high'], r['kind'])}"
        verdict = verdict_text(r)
        rows.append([f"`{r['case']}`", r["role"], f"{r['metric']} ({r['kind']}, {r['arms']})",
                     _figure_text(r["predicted"], r["kind"]), measured, effect_text(r), error_text(r),
                     verdict if verdict == "yes" else f"**{verdict}**", r["out_of_domain"] or "", r["source"],
                     r["note"] or ""])
    return table(["case", "role", "figure", "predicted", "measured", "effect predicted / measured", "error",
                  "within", "out of domain", "measured where", "what the model lacks"], rows, "lllrrrrlrll")


def generator_honesty_table() -> str:
    rows = [[f"`{r['model']}`", r["statistic"], f"{r['real']:.3f}", f"{r['generated']:.3f}",
             "" if r["error"] is None else f"{100 * r['error']:+.1f} %"]
            for r in exhibit("generator-honesty")["data"]["rows"]]
    return table(["preset", "statistic", "real", "generated", "error"], rows, "llrrr")


def generator_locality_table() -> str:
    def size(r):
        if r["kind"] == "hot_pairs":
            return f"hottest {100 * r['size']:.1f} % of pairs"
        if r["kind"] == "reuse_within":
            return f"d = {r['size']}"
        if r["kind"] == "adjacent":
            return "adjacent"
        return f"{r['size']:,} slots"
    rows = [[f"`{r['preset']}`", r["target"], size(r), f"{100 * r['measured']:.1f} %", f"{100 * r['generated']:.1f} %",
             f"{100 * r['error']:+.1f}", f"±{100 * r['tolerance']:.0f}", "fit" if r["fit"] else "check",
             "yes" if r["within"] else "**no**"]
            for r in exhibit("generator-locality")["data"]["rows"]]
    return table(["preset", "target", "size", "measured", "generated", "error (points)", "tolerance", "role",
                  "within"], rows, "lllrrrrll")


def _percent_or_blank(value: float | None, sign: str = "") -> str:
    """A recorded error as the replay tables print it: '' where the record has none."""
    return "" if value is None else f"{100 * value:{sign}.1f} %"


def replay_spread_table() -> str:
    """The GPU copy replay on several H200 machines (scenarios/hardware/calibration/h200-replay-spread.json)."""
    from sim.explore.validate import REPLAY_SPREAD_FILE

    percent = _percent_or_blank
    record = json.loads(REPLAY_SPREAD_FILE.read_text())
    rows = [[r["machine"], r["calibration"], r["seed"], f"{r['steps']:,}", r["way"], r["timing"], r["repeats"],
             percent(r["median_error"]), percent(r["p95_error"]), percent(r.get("noise_floor")),
             percent(r.get("host_drift"), "+"), percent(r.get("host_adjusted_median_error")),
             percent(r.get("anchor_adjusted_median_error")), f"{r['measured_s']:.2f} s", f"{r['predicted_s']:.2f} s"]
            for r in record["rows"]]
    return table(["machine", "calibration", "seed", "steps", "way", "timing", "runs", "median error", "p95 error",
                  "noise floor", "host drift", "at the replay's host state", "with the anchors", "measured",
                  "predicted"], rows, "lllrllrrrrrrrrr")


def replay_host_load_table() -> str:
    """The host-state experiment: calibrations under a host load and settled, replayed settled and under load
    (scenarios/hardware/calibration/h200-replay-host-load.json)."""
    from sim.explore.validate import REPLAY_SPREAD_FILE

    percent = _percent_or_blank
    record = json.loads((REPLAY_SPREAD_FILE.parent / "h200-replay-host-load.json").read_text())
    rows = [[r["machine"], r["calibration"], r["calibrated"], r["replayed"], r["seed"], percent(r["median_error"]),
             percent(r["host_adjusted_median_error"]), percent(r["anchor_adjusted_median_error"]),
             f"{r['measured_s']:.2f} s", f"{r['predicted_s']:.2f} s"]
            for r in record["rows"] if r["way"] == "ce_sync"]
    return table(["machine", "calibration", "calibrated", "replayed", "seed", "median error",
                  "at the replay's host state (probe)", "with the anchors", "measured", "predicted"], rows,
                 "llllrrrrrr")


def validation_replay_table() -> str:
    """The same replays per machine, as `expertsim validate` prints them (sim.explore.validate.replay_table)."""
    from sim.explore.validate import replay_by_machine, replay_table

    rows = replay_table(replay_by_machine())
    return table(list(rows[0]), [list(r.values()) for r in rows], "lllrrrrl")


def ds4_reserve_table() -> str:
    rows = [[r["reserve_gib"], f"{r['q2_slots']:,}", f"{r['q4_slots']:,}", f"{100 * r['decode_hit_rate']:.1f} %",
             f"{r['decode_tok_s']:.1f}"] for r in exhibit("memory")["data"]["reserve"]]
    return table(["reserve (GiB)", "q2 class slots", "q4 class slots", "decode hit rate", "decode tok/s"], rows, "rrrrr")


def strata_658_table() -> str:
    labels = {"strata-658-borrow": "`--expert-cache 5400`, borrow", "strata-658-own": "`--expert-cache 5400`, own",
              "strata-658-auto-borrow": "auto, borrow (upstream)", "strata-658-auto-own": "auto, own allowed (fork)"}
    data = exhibit("strata-658")["data"]
    rows = [[labels[n], f"{d['cache_slots']:,}", f"{d['cache_mib']:,.0f}", "owned" if d["owned"] else "borrowed",
             f"{d['chunk']:,}", f"{d['buffer_mib']:,.0f}", f"{d['lent_slots']:,}", f"{d['file_blob_reads']:,}",
             f"{d['prefill_tok_s']:,.1f}"] for n, d in data.items()]
    return table(["scenario", "cache slots", "cache MiB", "buffers", "chunk", "buffer MiB", "lent slots",
                  "file-blob reads", "prompt tok/s"], rows, "lrrlrrrrr")


def strata_reserve_table() -> str:
    rows = [[f"{r['reserve_mib']:,}", f"{r['cache_slots']:,}", f"{r['cache_mib']:,.0f}",
             "owned" if r["owned"] else "borrowed", f"{r['lent_slots']:,}", f"{r['prefill_tok_s']:,.0f}",
             f"{100 * r['decode_hit_rate']:.1f} %"] for r in exhibit("strata-reserve")["data"]["rows"]]
    return table(["--vram-reserve-mib", "cache slots", "cache MiB", "buffers", "lent slots", "prompt tok/s",
                  "decode hit rate"], rows, "rrrlrrr")


def conversation_table() -> str:
    data = exhibit("memory")["data"]["conversation"]
    rows = []
    for label, title in (("on", "2048 MiB (on)"), ("off", "0 (off)")):
        d = data[label]
        restore = "" if d["restore_ms"] is None else f"{d['restore_ms']:.1f}"
        rows.append([title, d["parks"], f"{d['resumed_tokens']:,}", restore, f"{d['prefill_ms']:,.0f}",
                     f"{d['ttft_s']:.2f}"])
    return table(["--conversation-cache-mib", "sessions parked", "tokens resumed by A's 2nd turn", "restore ms",
                  "A's 2nd turn: prompt ms", "TTFT s"], rows, "lrrrrr")


# ------------------------------------------------------------------------------------------ trace format

# What each part of the trace file means: the columns and keys come from the code (a file written by
# sim.trace.format.write_trace, the TraceHeader dataclass); a column or key without a note here fails the
# docs build, so a format change cannot leave this page behind.
TRACE_COLUMN_NOTES = {
    "request": "request id, >= 0",
    "position": "token index within the request (prompt first), >= 0",
    "phase": "0 prefill, 1 decode",
    "experts": "layer-major: entry `l·top_k + j` is `experts[row, l, j]`; 65535 marks a missing cell",
    "weights": "optional; same layout; gate weights (0 in missing cells)",
}
TRACE_HEADER_NOTES = {
    "model": "model name (a preset name, or `\"unknown (<importer>)\"`)",
    "n_layers": "MoE layers in the trace (layer index = position in axis 1)",
    "n_experts": "routed experts per layer",
    "top_k": "experts per token and layer",
    "source": "file name the trace came from, or a description for synthetic traces",
    "source_sha256": "SHA-256 (hex) of the source file's bytes, as imported",
    "generator": "how the trace was made (importer, variant, notes, the generator preset and seed)",
    "format_version": "the format's version",
}


def trace_parquet_schema() -> str:
    """The Parquet columns, their Arrow types and the schema metadata keys of a file write_trace makes."""
    import tempfile
    from pathlib import Path

    import numpy as np
    import pyarrow.parquet as pq

    from sim.trace import format as fmt

    header = fmt.TraceHeader("example", 2, 8, 2, "docs", "")
    experts = np.array([[[0, 1], [2, 3]]], np.uint16)  # one token: experts 0, 1 in layer 0 and 2, 3 in layer 1
    trace = fmt.Trace(header, np.zeros(1, np.int32), np.zeros(1, np.int32), np.zeros(1, np.uint8), experts,
                      np.zeros((1, 2, 2), np.float32))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "t.parquet"
        fmt.write_trace(trace, path)
        schema = pq.read_schema(path)
    # a 2-layer, top-2 file: its list width 4 stands for n_layers·top_k
    rows = [[f"`{f.name}`", f"`{str(f.type).replace('[4]', '[n_layers·top_k]')}`", TRACE_COLUMN_NOTES[f.name]]
            for f in schema]
    keys = [[f"`{k.decode()}`", "the header as JSON (sorted keys)" if k == fmt.METADATA_KEY
             else "`Trace.sha256()` of the content"] for k in schema.metadata]
    return (table(["column", "Arrow type", "notes"], rows) + "\nSchema metadata:\n\n"
            + table(["key", "value"], keys))


def trace_header() -> str:
    from dataclasses import fields

    from sim.trace.format import FORMAT_VERSION, TraceHeader

    rows = []
    for f in fields(TraceHeader):
        kind = f.type if isinstance(f.type, str) else f.type.__name__
        note = TRACE_HEADER_NOTES[f.name]
        if f.name == "format_version":
            note += f": `{FORMAT_VERSION}`"
        rows.append([f"`{f.name}`", kind, note])
    return table(["key", "type", "meaning"], rows)


# ------------------------------------------------------------------------------------------ benchmark

# docs/reference/bench.json: one recorded `expertsim bench --json` run (rows name, value, unit, target, met)
# with the machine it ran on. Timings depend on the machine and the run takes minutes, so the run is
# recorded (re-record it with `expertsim bench --json` after a change that can move a figure) and the docs
# test checks that the page shows that record.


def bench_record() -> dict:
    return json.loads((ROOT / "docs" / "reference" / "bench.json").read_text())


def _bench_value(row: dict) -> str:
    value = row["value"]
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, float):
        value = f"{value:,.4g}" if abs(value) < 1000 else f"{value:,.1f}"
    elif isinstance(value, int):
        value = f"{value:,}"
    return f"{value} {row.get('unit') or ''}".strip()


def bench_table() -> str:
    record = bench_record()
    met = {True: "yes", False: "**no**", None: ""}
    rows = [[f"`{r['name']}`", _bench_value(r), r.get("target") or "", met[r.get("met")]] for r in record["rows"]]
    return (f"Recorded {record['recorded']} on {record['machine']} (`{record['command']}`):\n\n"
            + table(["row", "value", "target", "met"], rows, "lrll"))


# docs/reference/validation-bands.json: one recorded `expertsim validate --uncertainty N --json` run (every arm on N
# Latin-hypercube samples of its estimated inputs) with the machine it ran on: minutes of runs, so recorded (re-record
# it after a change that moves a prediction; tests/test_validate.py checks its predictions are the current ones).


def validation_bands_record() -> dict:
    return json.loads((ROOT / "docs" / "reference" / "validation-bands.json").read_text())


def validation_bands_table() -> str:
    """Each prediction figure's p10-p90 band over the estimated inputs, and why a measured figure outside it is."""
    recorded = validation_bands_record()
    rows, inside, judged = [], 0, 0
    for r in recorded["record"]["rows"]:
        if r["role"] != "prediction" or r["metric"] is None or r.get("in_band") is None:
            continue
        judged += 1
        inside += bool(r["in_band"])
        measured = _figure_text(r["measured_low"], r["kind"])
        if r["measured_high"] != r["measured_low"]:
            measured += f"–{_figure_text(r['measured_high'], r['kind'])}"
        band = f"{_figure_text(r['band_p10'], r['kind'])}–{_figure_text(r['band_p90'], r['kind'])}"
        rows.append([f"`{r['case']}`", f"{r['metric']} ({r['kind']}, {r['arms']})", _figure_text(r["predicted"], r["kind"]),
                     band, measured, "yes" if r["in_band"] else "**no**", r.get("band_reason") or ""])
    return (f"Recorded {recorded['recorded']} on {recorded['machine']} (`{recorded['command']}`): {inside} of {judged} "
            "measured figures inside their band; every other one with the reason.\n\n"
            + table(["case", "figure", "predicted", "p10–p90", "measured", "in band", "why not"], rows, "llrrrll"))


REGIONS = {"replay-spread": replay_spread_table, "replay-host-load": replay_host_load_table, "validation-replay": validation_replay_table, "generator-honesty": generator_honesty_table,
           "generator-locality": generator_locality_table, "cli": cli, "seed-scenarios": seed_scenarios, "scenario-schema": scenario_schema, "hardware-schema": hardware_schema,
           "calibration-file": calibration_file, "validation-table": validation_table,
           "ds4-reserve-table": ds4_reserve_table, "strata-658-table": strata_658_table,
           "strata-reserve-table": strata_reserve_table, "conversation-table": conversation_table,
           "trace-parquet-schema": trace_parquet_schema, "trace-header": trace_header, "bench-table": bench_table,
           "validation-bands": validation_bands_table}


def render(name: str) -> str | None:
    fn = REGIONS.get(name)
    return None if fn is None else fn()
