"""Hardware profiles: every shipped profile validates, every number carries its source, bad files fail in one line."""

from __future__ import annotations

import hashlib
import json
import re
import tomllib
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.errors import InputError
from sim.hardware import HardwareProfile, load_hardware
from sim.schema import Quantity, validate
from sim.units import GIB, MIB

ROOT = Path(__file__).resolve().parents[1]
HARDWARE = ROOT / "scenarios" / "hardware"
PROFILES = sorted(HARDWARE.glob("*.toml"))
TAG = re.compile(r"^\[[SMHE](/[SMHE])*( from [SMHE](/[SMHE])*)?\] \S")
EXPECTED = {"rtx-5090-48gb-windows", "rtx-pro-6000-96gb", "rtx-4090", "rtx-4060ti-16gb", "h200",
            "rtx-5070ti-laptop-12gb", "dgx-spark-gb10", "strix-halo-128gb", "m5-pro-64gb",
            # the boxes of validation cases (scenarios/validation/)
            "rtx-5090-9700x-windows", "rtx-4090-14900k-32gb", "rx-7700xt-docker-10gib", "rtx-4070-laptop-8gb-windows",
            "rtx-5070-12gb-windows", "rtx-5080-16gb-windows", "rtx-3060-12gb", "rx-7700xt-12gb", "strix-halo-128gb-stock",
            "rx-7900xt-20gb-5900x", "rtx-4080-7950x", "rtx-4080-5975wx", "rtx-3090", "rtx-2080-10900x",
            "rx-6900xt-16gb-7900", "rtx-4070-12gb-wsl2", "rtx-pro-6000-maxq-9374f", "rtx-a1000-9900t",
            "rtx-pro-6000-maxq-9175f"}
UNIFIED = {"dgx-spark-gb10", "strix-halo-128gb", "strix-halo-128gb-stock", "m5-pro-64gb"}


def test_the_profiles_ship():
    assert {p.stem for p in PROFILES} == EXPECTED
    assert {p.stem for p in PROFILES if load_hardware(p).is_unified} == UNIFIED


@pytest.mark.parametrize("path", PROFILES, ids=lambda p: p.stem)
def test_profile_loads_by_path_and_by_name(path):
    by_path = load_hardware(path)
    by_name = load_hardware(path.stem)
    assert by_path.name == by_name.name == path.stem
    assert by_path == by_name
    assert by_path.path == path.resolve()
    assert by_path.vram_bytes > 7.9 * GIB and by_path.ram_bytes > 8 * GIB  # 8 GB cards report 8,188 MiB


def _numbers(node, path=""):
    """Every int/float leaf of raw TOML data with its parent table and key."""
    if isinstance(node, dict):
        for key, value in node.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                yield f"{path}.{key}", node, key
            else:
                yield from _numbers(value, f"{path}.{key}")
    elif isinstance(node, list):
        for i, item in enumerate(node):
            yield from _numbers(item, f"{path}[{i}]")


@pytest.mark.parametrize("path", PROFILES, ids=lambda p: p.stem)
def test_every_number_in_the_file_has_a_tagged_source(path):
    raw = tomllib.loads(path.read_text())
    found = list(_numbers(raw))
    assert len(found) >= 25
    for where, table, key in found:
        assert key in ("value", "queue_depth"), f"{path.name}{where}: a number outside a sourced quantity"
        assert TAG.match(table.get("source", "")), f"{path.name}{where}: source {table.get('source')!r}"
        if table.get("calibrated"):
            assert len(table.get("derivation", "")) > 20, f"{path.name}{where}: calibrated without derivation"


@pytest.mark.parametrize("path", PROFILES, ids=lambda p: p.stem)
def test_validated_quantities_match_their_units_and_compute_is_derived(path):
    profile = load_hardware(path)
    quantities = dict(profile.quantities())
    for key, q in quantities.items():
        assert isinstance(q, Quantity) and TAG.match(q.source)
        leaf = key.split(".")[-1].split("[")[0]
        suffix = {"gbps": "GB/s", "us": "us", "gib": "GiB", "mib": "MiB", "kib": "KiB", "layer": "us",
                  "threads": "threads", "cores": "cores", "tflops": "TFLOPS"}
        if leaf.endswith("per_gib"):
            assert q.unit == "us/GiB", key
        elif leaf != "read_gbps_by_queue_depth":
            assert q.unit == suffix[leaf.rsplit("_", 1)[-1]], key
    # the seeds' model classes have compute figures, each calibrated with its derivation
    assert set(profile.compute) >= {"deepseek-v4-flash", "qwen3.8-flash-next"}
    for key, q in quantities.items():
        if key.startswith("compute."):
            assert q.calibrated and q.derivation, key


@pytest.mark.parametrize("path", PROFILES, ids=lambda p: p.stem)
def test_profile_figures_are_physically_consistent(path):
    p = load_hardware(path)
    # A device-local copy reads and writes every byte: bytes copied per second stay below half the DRAM
    # bandwidth (the read+write double counting rule, hardware-and-gguf.md §1.1).
    assert p.d2d.copy_gbps.value <= p.gpu.dram_bandwidth_gbps.value / 2
    if p.is_unified:  # a copy inside the pool is bounded like a device-local one; the GPU gets a share of it
        assert p.unified.copy_gbps.value <= p.gpu.dram_bandwidth_gbps.value / 2
        assert p.host.os_reserved_gib.value < p.unified.gpu_allocatable_gib.value <= p.host.ram_gib.value
    else:
        assert p.pcie.h2d_pageable_gbps.value < p.pcie.h2d_pinned_gbps.value
        assert p.pcie.d2h_pageable_gbps.value < p.pcie.d2h_pinned_gbps.value
        assert p.pcie.h2d_pinned_gbps.value < 64  # no PCIe 5.0 x16 direction carries more
    assert p.host.dram_bandwidth_gbps.value <= p.gpu.dram_bandwidth_gbps.value or not p.is_unified
    assert p.wddm == (p.os == "windows")
    assert p.compute["deepseek-v4-flash"].decode_us_per_token_layer.value > \
        p.compute["deepseek-v4-flash"].prefill_us_per_token_layer.value


def test_unified_memory_copies_inside_the_pool_and_the_gpu_holds_its_share():
    spark = load_hardware("dgx-spark-gb10")
    rates = spark.copy_rates()
    assert {rates[k] for k in ("h2d_pinned", "d2h_pinned", "h2d_pageable", "d2h_pageable")} == {116e9}
    assert spark.vram_bytes == 121 * GIB == spark.ram_bytes  # ATS: the GPU may allocate the whole pool
    mac = load_hardware("m5-pro-64gb")
    assert mac.os == "macos" and mac.vram_bytes == 48 * GIB < mac.ram_bytes  # recommendedMaxWorkingSetSize


def test_windows_box_is_wddm_and_the_h200_uses_project_measurements():
    assert load_hardware("rtx-5090-48gb-windows").wddm
    h200 = load_hardware("h200")
    assert h200.vram_bytes == 143_771 * MIB
    assert h200.pcie.h2d_pinned_gbps.source.startswith("[H]")
    assert h200.ssd.max_request_kib.source.startswith("[H]")


def test_the_h200s_calibrated_figures_span_every_h200_calibration():
    """The H200 profile's per-call and copy-rate figures carry the machine-to-machine spread as their range: the
    lowest and highest value any committed H200 calibration stands for (its simulator_profile), rounded outward."""
    from sim.calibrate.fileformat import load, plain_parameters, simulator_profile

    files = [f for f in (ROOT / "scenarios" / "hardware" / "calibration").glob("h200*.json") if "replay" not in f.name]
    stands_for = [simulator_profile(plain_parameters(load(f))) for f in files]
    assert len(stands_for) >= 10
    profile = dict((path, q) for path, q in load_hardware("h200").quantities())
    for key in ("latency.memcpy_call_us", "latency.device_sync_us", "pcie.copy_fixed_latency_us", "d2d.copy_gbps"):
        values = [s[key] for s in stands_for]
        low, high = profile[key].range
        assert low <= min(values) < low + 0.01 * min(values) and high >= max(values) > high - 0.01 * max(values), key


def test_ssd_table_interpolates_and_compute_matches_longest_prefix():
    p = load_hardware("h200")
    table = [(q.queue_depth, q.value) for q in p.ssd.read_gbps_by_queue_depth]
    assert p.ssd_read_gbps(1) == table[0][1]
    assert p.ssd_read_gbps(1000) == table[-1][1]
    assert p.ssd_read_gbps(1.5) == pytest.approx((table[0][1] + table[1][1]) / 2)
    assert p.compute_key("deepseek-v4-flash-q2-q4") == "deepseek-v4-flash"
    assert p.compute_key("qwen3.8-flash-next-iq3s") == "qwen3.8-flash-next"
    assert p.compute_for("mixtral-8x7b") is None


# ------------------------------------------------------------------------------------- bad profiles

BASE = (HARDWARE / "rtx-4090.toml").read_text()
H2D = next(line for line in BASE.splitlines() if line.startswith("h2d_pinned_gbps"))
VRAM = next(line for line in BASE.splitlines() if line.startswith("vram_gib"))


def _error(tmp_path, text, name="bad.toml") -> str:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(InputError) as info:
        load_hardware(path)
    message = str(info.value)
    assert "\n" not in message and message.startswith(str(path))
    return message


@pytest.mark.parametrize("old, new, key, why", [
    (H2D, "h2d_pinned_gbps = 23.9", "pcie.h2d_pinned_gbps = 23.9", "needs its source"),
    (VRAM, 'vram_gib = { value = 24, unit = "GiB" }', "gpu.vram_gib.source", "required"),
    (VRAM, 'vram_gib = { value = 24, unit = "GiB", source = "24 GB, a spec" }', "gpu.vram_gib.source",
     "provenance tag"),
    (VRAM, 'vram_gib = { value = 24, unit = "GiB", source = "[X] 24 GB" }', "gpu.vram_gib.source", "provenance tag"),
    (VRAM, 'vram_gib = { value = 24, unit = "GB", source = "[S] 24 GB" }', "gpu.vram_gib.unit = GB", "'GiB'"),
    (VRAM, 'vram_gib = { value = -24, unit = "GiB", source = "[S] 24 GB" }', "gpu.vram_gib.value = -24", "> 0"),
    (VRAM, 'vram_gib = { value = "24", unit = "GiB", source = "[S] 24 GB" }', "gpu.vram_gib.value", "a number"),
    (VRAM, 'vram_gib = { value = 24, unit = "GiB", source = "[S] 24 GB", calibrated = true }',
     "gpu.vram_gib.derivation", "needs a derivation"),
    (VRAM, 'vram_gib = { value = 24, unit = "GiB", source = "[S] 24 GB", note = "x" }', "gpu.vram_gib.note",
     "unknown key"),
    ('os = "linux"', 'os = "bsd"', "os = bsd", "'linux', 'windows' or 'macos'"),
    ("[d2d]", '[d2d]\nfoo_gbps = { value = 1, unit = "GB/s", source = "[E] a guess" }', "d2d.foo_gbps",
     "unknown key; known: copy_gbps"),
    ("{ queue_depth = 4,", "{ queue_depth = 1,", "ssd.read_gbps_by_queue_depth", "strictly increase"),
    ("[pcie]", '[host.ggml_kernel_gbps]\nQ9_K = { value = 5, unit = "GB/s", source = "[H] here" }\n\n[pcie]',
     "host.ggml_kernel_gbps.Q9_K.[key] = Q9_K", "must be 'F32', 'F16'"),
    ("[pcie]", '[host.ggml_kernel_gbps]\nQ4_K = { value = 5, unit = "GB/s" }\n\n[pcie]',
     "host.ggml_kernel_gbps.Q4_K.source", "required"),
])
def test_bad_profile_is_one_line_naming_file_and_key(tmp_path, old, new, key, why):
    assert old in BASE
    message = _error(tmp_path, BASE.replace(old, new, 1))
    assert f": {key}" in message and why in message


def _replace_value(text: str, key: str, value: str) -> str:
    """The profile text with the figure `key` (a host.* key) set to `value`."""
    line = next(line for line in text.splitlines() if line.startswith(key + " = {"))
    return text.replace(line, re.sub(r"value = [^,]+,", f"value = {value},", line, count=1), 1)


@pytest.mark.parametrize("key, value, words", [
    # issue 34: each of these was taken without a word
    ("os_reserved_gib", "80", ("host.os_reserved_gib = 80 GiB", "must be below host.ram_gib (64 GiB)")),
    ("os_reserved_gib", "64", ("host.os_reserved_gib = 64 GiB", "must be below host.ram_gib (64 GiB)")),
    ("physical_cores", "32", ("host.physical_cores = 32 cores", "at most host.hardware_threads (16)")),
    ("hardware_threads", "16.5", ("host.hardware_threads.value = 16.5", "whole number")),
    ("physical_cores", "7.5", ("host.physical_cores.value = 7.5", "whole number")),
    ("ram_gib", "1e30", ("host.ram_gib.value = 1e+30", "<= 8388608")),
    ("memcpy_gbps", "1e8", ("host.memcpy_gbps.value = 100000000.0", "<= 10000000")),
    ("hardware_threads", "100000", ("host.hardware_threads.value = 100000", "<= 8192")),
])
def test_a_host_that_cannot_exist_is_refused(tmp_path, key, value, words):
    base = (HARDWARE / "rtx-4090.toml").read_text()  # 64 GiB of RAM, 16 threads, 8 cores
    message = _error(tmp_path, _replace_value(base, key, value))
    for word in words:
        assert word in message, (word, message)


BAD_FIGURES = {"NaN": float("nan"), "infinite": float("inf"), "minus infinite": float("-inf"), "negative": -1.0,
               "huge": 1e30}


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_fuzz_every_figure_of_every_profile_refuses_what_no_box_has(data):
    """Issue 34: every numeric field of every shipped profile refuses a non-finite, negative or huge value and a
    wrong unit, with one line naming the field (the field's key is in the message)."""
    path = data.draw(st.sampled_from(PROFILES), label="profile")
    dumped = load_hardware(path).model_dump(exclude_none=True)
    figures = []  # (key parts, the figure's table) of every sourced number, found by walking the dump

    def walk(parts, node):
        if isinstance(node, dict) and {"value", "unit", "source"} <= node.keys():
            figures.append((parts, node))
        elif isinstance(node, (dict, list)):
            for k, child in (node.items() if isinstance(node, dict) else enumerate(node)):
                walk(parts + (k,), child)

    walk((), dumped)
    parts, figure = data.draw(st.sampled_from(figures), label="field")
    kind = data.draw(st.sampled_from([*BAD_FIGURES, "wrong unit"]), label="bad value")
    if kind == "wrong unit":
        figure["unit"] = "furlongs"
    else:
        figure["value"] = BAD_FIGURES[kind]
        figure.pop("range", None)  # a range must hold the value: the value's own rule is under test
    with pytest.raises(InputError) as info:
        validate(str(path), HardwareProfile, dumped)
    message = str(info.value)
    assert "\n" not in message and message.startswith(str(path)), message
    dotted = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in parts).lstrip(".")
    assert f": {dotted}" in message or f": {'.'.join(map(str, parts))}" in message, (parts, message)


def test_missing_profile_and_bad_toml(tmp_path):
    with pytest.raises(InputError, match="no hardware profile nope.toml"):
        load_hardware("nope", base=tmp_path)
    with pytest.raises(InputError, match="no such file"):
        load_hardware(tmp_path / "nope.toml")
    assert "not valid TOML" in _error(tmp_path, BASE + "\n[[[\n")
    (tmp_path / "latin.toml").write_bytes(BASE.encode() + b"# \xff\n")
    with pytest.raises(InputError, match="UTF-8"):
        load_hardware(tmp_path / "latin.toml")


def test_calibration_file_is_resolved_next_to_the_profile_checked_and_hashed(tmp_path):
    text = BASE.replace('os = "linux"', 'os = "linux"\ncalibration = "cal/4090.json"')
    message = _error(tmp_path, text, "with-cal.toml")
    assert ": calibration = cal/4090.json: no such file" in message
    (tmp_path / "cal").mkdir()
    shipped = (HARDWARE / "calibration" / "rtx-5090.json").read_bytes()
    (tmp_path / "cal" / "4090.json").write_bytes(shipped)
    profile = load_hardware(tmp_path / "with-cal.toml")
    assert profile.calibration_path == (tmp_path / "cal" / "4090.json").resolve()
    assert profile.calibration_sha256 == hashlib.sha256(shipped).hexdigest()
    # a calibration file of another schema version is refused when the profile loads
    record = json.loads(shipped)
    record["schema_version"] = 999
    (tmp_path / "cal" / "4090.json").write_text(json.dumps(record))
    with pytest.raises(InputError, match="schema_version = 999"):
        load_hardware(tmp_path / "with-cal.toml")


def test_profiles_are_frozen():
    profile = load_hardware("rtx-4090")
    with pytest.raises(Exception):
        profile.os = "windows"
    assert isinstance(profile, HardwareProfile)


def test_h200_copy_figures_are_the_measured_calibration():
    """The H200 profile's copy costs are the ones `expertsim calibrate` measured, not estimates."""
    profile = load_hardware("h200")
    measured = json.loads(profile.calibration_path.read_text())["simulator_profile"]
    for dotted, value in measured.items():
        if dotted == "latency.kernel_launch_us":
            continue  # launch cost of the replay kernel, not of the engines' kernels
        section, field = dotted.split(".")
        quantity = getattr(getattr(profile, section), field)
        assert quantity.value == pytest.approx(value, abs=0.01), dotted
        assert "expertsim calibrate" in quantity.source
