"""The inputs of a run, shown or written: `expertsim hardware list | show | init`, `expertsim model show` and
`expertsim scenario init`."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from sim.cli.common import flag, force_option, hardware_app, model_app, print_json, scenario_app, wide_option
from sim.cli.tables import show, table
from sim.engines import ENGINES
from sim.errors import InputError
from sim.outputs import claim_file

ENGINE_NAMES = tuple(ENGINES)


@hardware_app.command("list")
def hardware_list(as_json: bool = flag("--json", help="print JSON only"),
                  wide: bool = wide_option()):
    """Every hardware profile a scenario can name from here (./hardware, ./scenarios/hardware, upward, then
    expertsim's own)."""
    from sim.hardware import find_profiles, load_hardware_file, profile_summary

    rows = []
    for path in find_profiles(Path.cwd()):
        try:
            rows.append(profile_summary(load_hardware_file(path.resolve())))
        except InputError as exc:  # one broken profile of the user's does not hide the others
            rows.append({"name": path.stem, "path": str(path), "error": str(exc)})
    if as_json:
        print_json(rows)
        return
    show(table("hardware profiles (vram_gib: none for unified memory; ssd_gbps at the deepest queue)", rows,
               ["name", "os", "memory", "vram_gib", "ram_gib", "ssd_gbps", "h2d_pinned_gbps", "calibrated", "path",
                *(["error"] if any("error" in r for r in rows) else [])]), wide=wide)


@hardware_app.command("show")
def hardware_show(profile: str = typer.Argument(..., metavar="PROFILE", help="a profile name or a .toml path"),
                  as_json: bool = flag("--json", help="print JSON only"),
                  wide: bool = wide_option()):
    """One profile's figures, each with its unit and source (and its range where it is an estimate)."""
    from sim.hardware import load_hardware, profile_figures, profile_summary

    loaded = load_hardware(profile)
    summary, figures = profile_summary(loaded), profile_figures(loaded)
    if as_json:
        print_json({"summary": summary, "figures": figures})
        return
    show(table(f"{summary['name']} ({summary['path']})", figures, ["key", "value", "unit", "source", "range"]),
         wide=wide)


@hardware_app.command("init")
def hardware_init(
    base: str = typer.Argument(..., metavar="BASE", help="the profile to copy: a name or a .toml path"),
    output: Path = typer.Option(..., "-o", "--output", help="profile TOML to write (e.g. hardware/NAME.toml: a "
                                                            "scenario beside hardware/ names it NAME)"),
    settings: list[str] = typer.Option([], "--set", metavar="FIELD=VALUE",
                                       help="change one field, e.g. gpu.vram_gib=48 (or vram_gib=48 where one table "
                                            "has it); its source then says it is your what-if; repeat for more"),
    name: Optional[str] = typer.Option(None, "--name", help="the copy's name (default: the output file's name)"),
    force: bool = force_option(),
    as_json: bool = flag("--json", help="print JSON only"),
    wide: bool = wide_option(),
):
    """A copy of a hardware profile with fields changed, its comments kept and its calibration path rebased."""
    from sim.scaffold import write_hardware

    claim_file(output, force, "--output")
    written = write_hardware(base, output, settings, name)
    if as_json:
        print_json(written)
        return
    rows = [{"key": k, "value": written[k]} for k in ("path", "name", "base", "calibration", "scenario_names_it")]
    rows[3:3] = [{"key": "--set", "value": f"{k} = {v}"} for k, v in written["changed"].items()]
    show(table(f"hardware profile written: {written['path']}", rows, ["key", "value"]), wide=wide)


def layout_for(model: Optional[str], trace_model: str):
    """--model as a preset name or a .gguf path; else the trace's own model if it is a preset."""
    from sim.model.presets import get_preset, preset_names

    if model is None:
        return get_preset(trace_model) if trace_model in preset_names() else None
    if model.endswith(".gguf") or Path(model).is_file():
        from sim.model.gguf_reader import layout_from_gguf

        return layout_from_gguf(model)
    return get_preset(model)


@model_app.command("list")
def model_list(as_json: bool = flag("--json", help="print JSON only"),
               wide: bool = wide_option()):
    """Every model preset a scenario can name (a .gguf file can be named too): its geometry and expert bytes."""
    from sim.model.presets import PRESETS, preset_names

    rows = []
    for name in preset_names():
        d = PRESETS[name].describe()
        rows.append({"name": name, "layers": d["routed_layers"], "mtp_layers": d["mtp_layers"],
                     "experts": d["experts_per_layer"], "top_k": d["top_k"], "classes": len(d["size_classes"]),
                     "expert_gib": round(d["total_expert_gib"], 1)})
    if as_json:
        print_json(rows)
        return
    # 80 columns: the MTP layers are in `model show`
    show(table("model presets (GiB: all routed experts; model show NAME: more)",
               [{**row, "GiB": row["expert_gib"]} for row in rows], ["name", "layers", "experts", "top_k", "classes",
                                                                      "GiB"]), wide=wide)


@model_app.command("show")
def model_show(model: str = typer.Argument(..., metavar="MODEL", help="a model preset name or a .gguf file"),
               as_json: bool = flag("--json", help="print JSON only"),
               wide: bool = wide_option()):
    """A model's routed-expert layout: layers, experts, top-k, and per size class the bytes of one expert."""
    layout = layout_for(model, "")
    described = layout.describe()
    if as_json:
        print_json(described)
        return
    show(table(f"{described['name']}: {described['source']}",
               [{"key": k, "value": v} for k, v in described.items() if k not in ("size_classes", "source", "name")],
               ["key", "value"]), wide=wide)
    show(table("size classes (one cache per class in ds4 since PR #504)", described["size_classes"]), wide=wide)


@scenario_app.command("init")
def scenario_init(
    model: str = typer.Option(..., "--model", help="a model preset or a .gguf file"),
    hardware: str = typer.Option(..., "--hardware", help="a hardware profile name or a .toml path"),
    engine: str = typer.Option("auto", "--engine", help=f"auto | {' | '.join(ENGINE_NAMES)} (auto: the engine that "
                                                        "runs the model, else a cache-only replay)"),
    variant: Optional[str] = typer.Option(None, "--variant", help="the engine build (default: its newest for the "
                                                                  "model)"),
    # a starting workload, our choice: one chat-sized request, simulated in seconds
    prompt_tokens: int = typer.Option(2048, "--prompt-tokens", min=1, help="the request's prompt tokens"),
    decode_tokens: int = typer.Option(256, "--decode-tokens", min=0, help="the request's tokens of answer"),
    settings: list[str] = typer.Option([], "--set", metavar="KEY=VALUE",
                                       help="set one scenario key, as run --set does (e.g. "
                                            "engine.flags.prefill-chunk=4096); repeat for more"),
    output: Path = typer.Option(..., "-o", "--output", help="scenario TOML to write"),
    force: bool = force_option(),
    as_json: bool = flag("--json", help="print JSON only"),
    wide: bool = wide_option(),
):
    """Write a commented starting scenario for a model on a machine: the engine's defaults, each line explained."""
    from sim.scaffold import write_scenario

    claim_file(output, force, "--output")
    written = write_scenario(output, model, hardware, prompt_tokens, decode_tokens, engine, variant, settings)
    if as_json:
        print_json(written)
        return
    trace = written["trace"]
    rows = [{"key": "path", "value": written["path"]},
            {"key": "engine", "value": f"{written['engine']} ({written['engine_choice']})"},
            *([{"key": "variant", "value": written["variant"]}] if written["variant"] else []),
            {"key": "model", "value": written["model"]}, {"key": "hardware", "value": written["hardware"]},
            {"key": "trace", "value": trace.get("path") or f"generator {trace['generator']}, seed {trace['seed']}"},
            {"key": "workload", "value": f"{prompt_tokens:,} prompt tokens, {decode_tokens:,} tokens of answer"},
            *({"key": "--set", "value": f"{k} = {v}"} for k, v in written["settings"].items()),
            *({"key": "changed", "value": f"{k} = {v['value']}: {v['why']}"}
              for k, v in written["room_for_a_cache"].items()),
            *([{"key": "compute", "value": written["compute_derived"]}] if written["compute_derived"] else []),
            {"key": "next", "value": f"expertsim run {written['path']} -o OUT"}]
    show(table(f"scenario written: {written['path']}", rows, ["key", "value"]), wide=wide)
    if written["warning"]:
        show(f"warning: {written['warning']}")
