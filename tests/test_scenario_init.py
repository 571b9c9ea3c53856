"""`expertsim scenario init` and `expertsim hardware init` as a user meets them: files that load and run,
a comment on every setting, --force, strict JSON, one-line errors; and the text edits behind a profile copy."""

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from sim.engines import ENGINES
from sim.hardware import load_hardware, load_hardware_file
from sim.scenario import load_scenario

ROOT = Path(__file__).resolve().parents[1]
# Small workloads: each run below takes a second or two.
SHORT = ["--prompt-tokens", "64", "--decode-tokens", "8"]


def expertsim(*args, cwd: Path, check: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "120"}
    proc = subprocess.run([sys.executable, "-m", "sim", *map(str, args)], capture_output=True, text=True, env=env,
                          cwd=cwd)
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def strict_json(text: str):
    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


def one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> str:
    assert proc.returncode == 2 and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def setting_lines(text: str) -> list[str]:
    """The lines that set a value: neither comments, blank, nor table headers."""
    return [line for line in text.splitlines() if line.strip() and not line.lstrip().startswith(("#", "["))]


@pytest.mark.parametrize("model, engine, variant", [
    ("deepseek-v4-flash-q2-q4", "ds4", "pr1082"),
    ("qwen3.8-flash-next-iq3s", "strata", "v0.1.40"),
    ("qwen3-30b-a3b", "replay", None),  # neither engine runs it: a cache-only replay
])
def test_each_engine_choice_writes_a_scenario_that_loads_and_runs(tmp_path, model, engine, variant):
    written = strict_json(expertsim("scenario", "init", "--model", model, "--hardware", "rtx-4090", *SHORT,
                                    "-o", "start.toml", "--json", cwd=tmp_path).stdout)
    assert (written["engine"], written["variant"], written["model"], written["hardware"]) == \
        (engine, variant, model, "rtx-4090")
    assert written["path"] == "start.toml" and written["settings"] == {}
    text = (tmp_path / "start.toml").read_text()
    assert text.startswith("# Scenario: ") and "\n# Covers: " in text
    assert all("  # " in line for line in setting_lines(text)), [l for l in setting_lines(text) if "  # " not in l]
    scenario = load_scenario(tmp_path / "start.toml")
    assert scenario.engine.name == engine and scenario.trace.generator == model
    summary = strict_json(expertsim("run", "start.toml", "-o", "out", "--json", cwd=tmp_path).stdout)
    assert summary["engine"] == engine and (tmp_path / "out" / "summary.json").is_file()


def test_a_file_only_ik_llama_cpp_loads_gets_its_build(tmp_path):
    """glm-5.1-iq3_ks holds ik_llama.cpp's own IQ3_KS / IQ4_KS experts: the automatic choice skips the engines and
    builds that would refuse the file and takes the llama.cpp family's ik variant."""
    written = strict_json(expertsim("scenario", "init", "--model", "glm-5.1-iq3_ks", "--hardware",
                                    "rtx-pro-6000-maxq-9175f", *SHORT, "-o", "glm.toml", "--json", cwd=tmp_path).stdout)
    assert (written["engine"], written["variant"]) == ("llama.cpp", "ik")
    assert load_scenario(tmp_path / "glm.toml").engine.variant == "ik"
    # ik has no --fit: the 320 GiB of experts do not fit the 96 GB card, so the start keeps the fewest last MoE
    # layers' experts in host RAM that leave mainline --fit's 1 GiB spare, and one layer fewer would not
    n_cpu = written["room_for_a_cache"]["engine.flags.n-cpu-moe"]["value"]
    assert written["warning"] is None and 0 < n_cpu < 76
    text = (tmp_path / "glm.toml").read_text()
    for n, fits in ((n_cpu, True), (n_cpu - 1, False)):
        path = tmp_path / f"glm-{n}.toml"
        path.write_text(text.replace(f"n-cpu-moe = {n_cpu} ", f"n-cpu-moe = {n} ", 1))
        scenario = load_scenario(path)
        assert scenario.engine.flags.n_cpu_moe == n
        assert (ENGINES["llama.cpp"].plan_memory(scenario).free_at_sizing_bytes >= 2**30) is fits


def test_ik_starts_without_pinned_buffers_where_its_cpu_experts_exceed_the_ram(tmp_path):
    """rtx-4090.toml's box has 64 GiB of RAM: the 75 MoE layers' experts ik must keep in host memory for the rest to
    fit the 24 GB card (~299 GiB) cannot be read into pinned CUDA_Host buffers, and ik drops the file mapping for
    overridden tensors while pinning is on (llamacpp-engine.md §7), so the load would fail. The start sets
    GGML_CUDA_NO_PINNED=1 beside --n-cpu-moe, ik keeps the mapping, and the run reads the experts through the page
    cache. A user's own pinning setting is kept, with the refusal as the warning."""
    written = strict_json(expertsim("scenario", "init", "--model", "glm-5.1-iq3_ks", "--hardware", "rtx-4090", *SHORT,
                                    "-o", "glm.toml", "--json", cwd=tmp_path).stdout)
    assert written["warning"] is None, written["warning"]
    changed = written["room_for_a_cache"]
    assert list(changed) == ["engine.flags.n-cpu-moe", "engine.env.GGML_CUDA_NO_PINNED"]
    assert changed["engine.env.GGML_CUDA_NO_PINNED"]["value"] == "1"
    assert "pinned CUDA_Host fails" in changed["engine.env.GGML_CUDA_NO_PINNED"]["why"]
    scenario = load_scenario(tmp_path / "glm.toml")
    plan = ENGINES["llama.cpp"].plan_memory(scenario)
    assert plan.why_no_cache is None and "file mapping" in plan.notices[0]
    kept = strict_json(expertsim("scenario", "init", "--model", "glm-5.1-iq3_ks", "--hardware", "rtx-4090", *SHORT,
                                 "--set", "engine.env.GGML_CUDA_NO_PINNED=0", "-o", "kept.toml", "--json",
                                 cwd=tmp_path).stdout)
    assert list(kept["room_for_a_cache"]) == ["engine.flags.n-cpu-moe"] and "pinned CUDA_Host" in kept["warning"]


@pytest.mark.parametrize("hardware, resident", [("rtx-4070-12gb-wsl2", True), ("rtx-4090", False)])
def test_strata_starts_in_resident_mode_where_its_arena_exceeds_the_ram(tmp_path, hardware, resident):
    """The arena, Strata's default RAM mode, reads all 24,576 IQ3_S experts into RAM: 46.84 GiB (strata-engine.md
    §2.2), more than a 31 GiB box holds beside its OS (rtx-4070-12gb-wsl2.toml: 31 GiB, 4 reserved) and less than a
    64 GiB one. Before, the 31 GiB box started in the arena and ran as if it held it (a notice said it did not);
    a RAM mode the user sets is kept."""
    model = ["--model", "qwen3.8-flash-next-iq3s", "--hardware", hardware, *SHORT]
    expertsim("scenario", "init", *model, "-o", "s.toml", cwd=tmp_path)
    flags = tomllib.loads((tmp_path / "s.toml").read_text())["engine"]["flags"]
    assert flags.get("resident-experts", False) is resident
    assert ("resident-experts = false" in (tmp_path / "s.toml").read_text()) is not resident  # in "Also, at ..."
    summary = strict_json(expertsim("run", "s.toml", "--json", cwd=tmp_path).stdout)
    assert not any("arena" in notice and "exceed" in notice for notice in summary["notices"])
    expertsim("scenario", "init", *model, "--set", "engine.flags.resident-budget-gib=8", "-o", "b.toml", cwd=tmp_path)
    flags = tomllib.loads((tmp_path / "b.toml").read_text())["engine"]["flags"]
    assert "resident-experts" not in flags and flags["resident-budget-gib"] == 8


RESERVE = "engine.env.DS4_CUDA_STREAMING_EXPERT_CACHE_RESERVE_GB"


def test_the_starting_point_on_a_24_gb_card_has_an_expert_cache_and_says_which_default_it_changed(tmp_path):
    """Issue 34: init for DeepSeek V4 Flash on an RTX 4090 kept ds4's default reserve (16 GiB, clamped to 12 on a
    24 GB card), which leaves no expert cache. The reserve is set to the whole GiB holding one layer's 256 q4
    experts (256 x 13.5 MiB = 3.375 GiB -> 4, ds4-engine.md §1.7), the line and the output say why, and the run
    has a cache. A reserve the user sets is kept, with the warning."""
    written = strict_json(expertsim("scenario", "init", "--model", "deepseek-v4-flash-q2-q4", "--hardware", "rtx-4090",
                                    *SHORT, "-o", "start.toml", "--json", cwd=tmp_path).stdout)
    assert written["room_for_a_cache"][RESERVE]["value"] == "4" and "no expert cache" in \
        written["room_for_a_cache"][RESERVE]["why"]
    assert written["warning"] is None
    line = next(line for line in (tmp_path / "start.toml").read_text().splitlines()
                if line.startswith("DS4_CUDA_STREAMING_EXPERT_CACHE_RESERVE_GB"))
    assert line.startswith('DS4_CUDA_STREAMING_EXPERT_CACHE_RESERVE_GB = "4"  # set here: ds4\'s default reserve')
    summary = strict_json(expertsim("run", "start.toml", "--json", cwd=tmp_path).stdout)
    assert summary["cache_slots"] > 0

    kept = strict_json(expertsim("scenario", "init", "--model", "deepseek-v4-flash-q2-q4", "--hardware", "rtx-4090",
                                 *SHORT, "--set", f"{RESERVE}=12", "-o", "mine.toml", "--json", cwd=tmp_path).stdout)
    assert kept["room_for_a_cache"] == {} and "no expert cache" in kept["warning"]
    assert load_scenario(tmp_path / "mine.toml").engine.env.DS4_CUDA_STREAMING_EXPERT_CACHE_RESERVE_GB == "12"


def test_a_card_where_no_setting_gives_a_cache_gets_a_warning(tmp_path):
    """A 12 GB card cannot hold what ds4 loads before its cache: no reserve helps, and init says so."""
    written = strict_json(expertsim("scenario", "init", "--model", "deepseek-v4-flash-q2-q4", "--hardware",
                                    "rtx-3060-12gb", *SHORT, "-o", "small.toml", "--json", cwd=tmp_path).stdout)
    assert written["room_for_a_cache"] == {} and "before its expert cache" in written["warning"]
    assert "# Note: " in (tmp_path / "small.toml").read_text()


def test_a_setting_is_typed_as_run_set_types_it_and_says_it_is_set_here(tmp_path):
    written = strict_json(expertsim("scenario", "init", "--model", "qwen3.8-flash-next-iq3s", "--hardware",
                                    "rtx-4090", *SHORT, "--set", "engine.flags.vram-reserve-mib=1536",
                                    "--set", "engine.env.STRATA_RESIDENT_HEADROOM_GIB=6", "-o", "s.toml", "--json",
                                    cwd=tmp_path).stdout)
    assert written["settings"] == {"engine.flags.vram-reserve-mib": 1536,
                                   "engine.env.STRATA_RESIDENT_HEADROOM_GIB": "6"}
    scenario = load_scenario(tmp_path / "s.toml")
    assert scenario.engine.flags.vram_reserve_mib == 1536 and scenario.engine.env.STRATA_RESIDENT_HEADROOM_GIB == "6"
    reserve = next(line for line in (tmp_path / "s.toml").read_text().splitlines()
                   if line.startswith("vram-reserve-mib"))
    assert "set here" in reserve and "default: 700" in reserve


def test_an_existing_file_is_kept_without_force(tmp_path):
    args = ["scenario", "init", "--model", "qwen3-30b-a3b", "--hardware", "rtx-4090", *SHORT, "-o", "s.toml"]
    expertsim(*args, cwd=tmp_path)
    before = (tmp_path / "s.toml").read_text()
    one_line_error(expertsim(*args, "--decode-tokens", "9", cwd=tmp_path, check=False), "s.toml", "--force")
    assert (tmp_path / "s.toml").read_text() == before
    expertsim(*args, "--decode-tokens", "9", "--force", cwd=tmp_path)
    assert load_scenario(tmp_path / "s.toml").workload.requests[0].decode_tokens == 9


@pytest.mark.parametrize("setting, needle", [
    ("engine.flags.no-such-flag=1", "engine.flags.no-such-flag"),
    ("no_such_key=1", "no_such_key"),
    ("engine.flags.vram-reserve-mib=lots", "engine.flags.vram-reserve-mib"),
])
def test_a_bad_setting_is_one_line_and_writes_nothing(tmp_path, setting, needle):
    proc = expertsim("scenario", "init", "--model", "qwen3.8-flash-next-iq3s", "--hardware", "rtx-4090", *SHORT,
                     "--set", setting, "-o", "s.toml", cwd=tmp_path, check=False)
    assert one_line_error(proc, needle).startswith("expertsim: error: s.toml")
    assert list(tmp_path.iterdir()) == []  # neither the file nor its temporary twin


def test_a_model_no_generator_covers_needs_a_trace_file(tmp_path):
    from gguf.constants import GGMLQuantizationType as Q

    from tests.test_gguf_reader import expert_tensors, moe_kv, write_gguf

    tensors = [t for block in (0, 1) for t in expert_tensors(block, 4, 256, 256, (Q.Q4_K, Q.Q4_K, Q.Q8_0))]
    write_gguf(tmp_path / "tiny.gguf", tensors, moe_kv(2, 4, 2) | {"general.name": "tiny-moe"})
    args = ["scenario", "init", "--model", "tiny.gguf", "--hardware", "rtx-4090", *SHORT, "-o", "sub/s.toml"]
    one_line_error(expertsim(*args, cwd=tmp_path, check=False), "no generator preset", "trace.path")
    rows = [f"0,{pos},{'prefill' if pos < 64 else 'decode'},{layer},{(pos + layer) % 4},{(pos + layer + 1) % 4}"
            for pos in range(64 + 8) for layer in (0, 1)]  # SHORT's workload: 64 prompt tokens, then 8
    (tmp_path / "tiny.csv").write_text("request,position,phase,layer,e0,e1\n" + "\n".join(rows) + "\n")
    expertsim("trace", "import", "tiny.csv", "--n-experts", 4, "-o", "sub/tiny.parquet", cwd=tmp_path)
    written = strict_json(expertsim(*args, "--set", "trace.path=tiny.parquet", "--json", cwd=tmp_path).stdout)
    assert written["engine"] == "replay" and written["model"] == "../tiny.gguf"  # rebased into sub/
    assert written["trace"] == {"path": "tiny.parquet"}
    expertsim("run", "sub/s.toml", "-o", "out", cwd=tmp_path)


def test_hardware_init_changes_a_figure_and_a_scenario_names_the_copy(tmp_path):
    base = ROOT / "scenarios" / "hardware" / "rtx-pro-6000-96gb.toml"
    written = strict_json(expertsim("hardware", "init", "rtx-pro-6000-96gb", "--set", "vram_gib=48",
                                    "-o", "hardware/what-if-48gb.toml", "--json", cwd=tmp_path).stdout)
    assert written["changed"] == {"gpu.vram_gib": "48 GiB"} and written["scenario_names_it"] == "what-if-48gb"
    shown = strict_json(expertsim("hardware", "show", "hardware/what-if-48gb.toml", "--json", cwd=tmp_path).stdout)
    assert shown["summary"]["vram_gib"] == 48 and shown["summary"]["name"] == "what-if-48gb"
    copy = load_hardware_file(tmp_path / "hardware" / "what-if-48gb.toml")
    assert "what-if set by the user" in copy.gpu.vram_gib.source
    assert copy.calibration_path == load_hardware("rtx-pro-6000-96gb").calibration_path  # rebased: the same file
    text = (tmp_path / "hardware" / "what-if-48gb.toml").read_text()
    assert {line for line in base.read_text().splitlines() if line.startswith("#")} <= set(text.splitlines())
    expertsim("scenario", "init", "--model", "deepseek-v4-flash-q2-q4", "--hardware", "what-if-48gb", *SHORT,
              "--set", "engine.env.DS4_CUDA_STREAMING_EXPERT_CACHE_RESERVE_GB=8", "-o", "s.toml", cwd=tmp_path)
    assert tomllib.loads((tmp_path / "s.toml").read_text())["hardware"] == "what-if-48gb"
    summary = strict_json(expertsim("run", "s.toml", "--json", cwd=tmp_path).stdout)
    assert summary["hardware"] == "what-if-48gb" and summary["cache_slots"] > 0


@pytest.mark.parametrize("setting, needles", [
    ("vram_gbps=48", ["vram_gbps", "unknown profile field"]),
    ("vram_gib=lots", ["gpu.vram_gib", "lots", "a number in GiB"]),
    ("vram_gib=-4", ["gpu.vram_gib", "-4"]),
    ("gpu.vram_gib=nan", ["gpu.vram_gib", "nan", "finite"]),  # issue 34: a ValueError traceback before
    ("gpu.vram_gib=inf", ["gpu.vram_gib", "inf", "finite"]),
    ("dram_bandwidth_gbps=100", ["gpu.dram_bandwidth_gbps", "host.dram_bandwidth_gbps"]),  # two tables have it
    ("host.simd=sse", ["host.simd", "sse", "avx2, avx512, neon"]),
])
def test_hardware_init_refuses_a_bad_field_or_value_in_one_line(tmp_path, setting, needles):
    proc = expertsim("hardware", "init", "rtx-4090", "--set", setting, "-o", "x.toml", cwd=tmp_path, check=False)
    one_line_error(proc, *needles)
    assert list(tmp_path.iterdir()) == []


def test_hardware_init_edits_in_place_adds_what_is_missing_and_keeps_the_rest(tmp_path):
    base = ROOT / "scenarios" / "hardware" / "rtx-4090.toml"
    expertsim("hardware", "init", base, "--set", 'compute."qwen3.8-flash-next".decode_us_per_token_layer=150',
              "--set", "compute.deepseek-v4-flash.prefill_us_per_chunk_layer=20", "--set", "os=windows",
              "--name", "my-4090", "-o", "h.toml", cwd=tmp_path)
    before, after = tomllib.loads(base.read_text()), tomllib.loads((tmp_path / "h.toml").read_text())
    assert after["name"] == "my-4090" and after["os"] == "windows"
    assert after["compute"]["qwen3.8-flash-next"]["decode_us_per_token_layer"]["value"] == 150
    assert after["compute"]["deepseek-v4-flash"]["prefill_us_per_chunk_layer"]["value"] == 20
    for key in ("gpu", "host", "pcie", "ssd", "d2d", "latency"):
        assert after[key] == before[key]
    one_line_error(expertsim("hardware", "init", base, "-o", "h.toml", cwd=tmp_path, check=False), "--force")


def test_hardware_init_sets_the_hosts_vector_instructions_with_their_source(tmp_path):
    # host.simd is a word with its source, not a quantity: one --set writes both (a traceback before: the copy
    # declared host.simd twice)
    expertsim("hardware", "init", "rtx-4090", "--set", "host.simd=avx512", "-o", "x.toml", cwd=tmp_path)
    simd = tomllib.loads((tmp_path / "x.toml").read_text())["host"]["simd"]
    assert simd["value"] == "avx512" and "what-if set by the user" in simd["source"] and "rtx-4090 has avx2" in \
        simd["source"]


def test_on_a_mac_the_automatic_choice_skips_the_engines_without_a_backend_there(tmp_path):
    """Strata runs qwen3.8-flash-next-iq3s, but has no Metal backend: on the M5 Pro the automatic choice fell on it
    and the scenario it wrote ran as if Strata ran there. Now it is a cache-only replay, saying which engine runs
    the model elsewhere and why not here; and the written scenario loads and runs."""
    written = strict_json(expertsim("scenario", "init", "--model", "qwen3.8-flash-next-iq3s", "--hardware",
                                    "m5-pro-64gb", *SHORT, "-o", "mac.toml", "--json", cwd=tmp_path).stdout)
    assert written["engine"] == "replay"
    why = written["engine_choice"]
    assert "strata runs it, but not on m5-pro-64gb" in why and "no Metal backend" in why
    assert strict_json(expertsim("run", "mac.toml", "--json", cwd=tmp_path).stdout)["engine"] == "replay"
