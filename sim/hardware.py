"""Hardware profiles: the machine a scenario runs on, every number with its source.

A profile is one TOML file in scenarios/hardware/. Each quantity is a table

    h2d_pinned_gbps = { value = 56.3, unit = "GB/s", source = "[M] nvbandwidth, tinygrad/open-gpu-kernel-modules#29" }

and a bare number is refused: the schema has no place for a figure without provenance. The source starts
with the tag of reference/hardware-and-gguf.md: [S] vendor spec, [M] public measurement, [H] measured by
this project, [E] estimate (combinations such as "[E from M]" are allowed). A figure that is fitted, or
meant to be fitted, against end-to-end measurements says `calibrated = true` and carries its `derivation`.

Units are part of the field name (`_gbps`, `_us`, `_gib`, `_kib`) and the table's `unit` must repeat it,
so a value typed in the wrong unit is caught where it is written. GB/s = 1e9 B/s; GiB, MiB, KiB are binary.
D2D copy rates are *bytes copied* per second: benchmarks that report device-local copies count read +
write, so a reported figure is halved (hardware-and-gguf.md §1.1).
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, Field, PrivateAttr, ValidationInfo, field_validator, model_validator

from sim.errors import InputError
from sim.model.quant import GGML_TYPES
from sim.schema import Quantity, Strict, display_path, is_file, parse_toml, quantity, read_bytes, safe_path, \
    sha256_file, validate
from sim.units import GIB, MIB

REPO_SCENARIOS = Path(__file__).resolve().parents[1] / "scenarios"


# The largest figure each unit admits. Sizes: 2**53 bytes (8 PiB), the most a float64 counts byte-exactly, so byte
# arithmetic stays exact (vram_gib = 1e30 was taken and overflowed later). Rates: 10,000,000 GB/s and TFLOPS, a
# thousand times the fastest part shipping (B200: 8 TB/s HBM3e, 9,000 dense FP4 TFLOPS, NVIDIA's datasheet): room
# for a what-if box whose link is made free (tests/test_engine_mechanisms.py makes I/O 1000x faster), none for 1e30.
# Times: 1e9 us (1,000 s) for one operation. CPUs: 8,192, the most Linux supports (x86-64 CONFIG_NR_CPUS, Kconfig).
# Queue depth: 65,536, the most entries of an NVMe I/O queue (NVMe base specification, CAP.MQES).
MAX_BYTES = 2**53
MAX_GBPS = 10_000_000.0
MAX_TFLOPS = 10_000_000.0
MAX_MICROS = 1e9
MAX_CPUS = 8_192
MAX_QUEUE_DEPTH = 65_536
GBps = quantity("GB/s", gt=0, le=MAX_GBPS)
TFlops = quantity("TFLOPS", gt=0, le=MAX_TFLOPS)
Micros = quantity("us", ge=0, le=MAX_MICROS)
MicrosPerGiB = quantity("us/GiB", ge=0, le=MAX_MICROS)
GiBs = quantity("GiB", gt=0, le=MAX_BYTES / GIB)
GiBsOrZero = quantity("GiB", ge=0, le=MAX_BYTES / GIB)
MiBs = quantity("MiB", ge=0, le=MAX_BYTES / MIB)
KiBs = quantity("KiB", gt=0, le=MAX_BYTES / 1024)
Threads = quantity("threads", ge=1, le=MAX_CPUS, whole=True)
Cores = quantity("cores", ge=1, le=MAX_CPUS, whole=True)
# One point of the SSD table: the read bandwidth reached at `queue_depth` requests in flight.
SsdPoint = quantity("GB/s", gt=0, le=MAX_GBPS,
                    extra=(("queue_depth", Annotated[int, Field(ge=1, le=MAX_QUEUE_DEPTH)]),))


# ------------------------------------------------------------------------------------------- profile


class Gpu(Strict):
    model: str = Field(min_length=1)
    # The GPU programming interface the engines run on it: CUDA (NVIDIA), HIP (AMD ROCm) or Metal (Apple).
    api: Literal["cuda", "hip", "metal"] = "cuda"
    vram_gib: GiBs | None = None  # device memory; absent on unified memory (the pool is host.ram_gib)
    dram_bandwidth_gbps: GBps  # spec DRAM bandwidth: what decode compute scales with
    # What the driver and the runtime (CUDA/HIP/Metal context, WDDM's reservation) hold before the engine
    # allocates anything: device memory on a discrete card, the shared pool on unified memory.
    runtime_reserved_mib: MiBs
    # A prompt's attention over its context on this GPU (FlashAttention's QK and AV FLOPs per second), where measured;
    # absent, an engine prices those FLOPs at its model class's prompt figure (sim/machine Machine.attention_s).
    attention_tflops: TFlops | None = None


class Simd(Strict):
    """The widest vector instructions the host's cores run: which of ggml's CPU kernels llama.cpp's build uses
    (sim/engines/llamacpp/kernels.py)."""
    value: Literal["avx2", "avx512", "neon"]
    source: str = Field(min_length=1)


class Host(Strict):
    cpu: str = Field(min_length=1)
    hardware_threads: Threads  # what engines size their thread pools from (Strata's stagers: hw / 4)
    # cores, not SMT threads: Strata's expert pool runs a worker on every core but its host thread's, which joins
    physical_cores: Cores
    # Expert weights one core's dequantize-and-dot kernel consumes per second in an engine's CPU expert pool
    # (Strata computes decode misses there): the pool's rate is this x its threads, at most the share of the DRAM
    # rate the copies and DMA in flight leave it (sim/machine Machine.cpu_kernel).
    expert_kernel_gbps: GBps
    # AVX2, AVX-512 or NEON: the kernels of ggml's CPU backend a llama.cpp build runs here. Absent: llama.cpp's CPU
    # experts run at expert_kernel_gbps, said in a notice.
    simd: Simd | None = None
    # One core's rate in mainline ggml's CPU kernels per GGML type, where measured on this host (python -m
    # sim.calibrate.ggml_kernels): llama.cpp's CPU experts of these types, and of their families, run at them
    # instead of the records measured on a Zen 4 core (sim/engines/llamacpp/kernels.py). Absent: the records.
    ggml_kernel_gbps: dict[Literal[GGML_TYPES], GBps] | None = None
    ram_gib: GiBs  # host RAM; on unified memory the whole pool the GPU shares
    # RAM the OS, its desktop and other processes hold while the engine runs: neither the engine nor the
    # page cache can have it.
    os_reserved_gib: GiBsOrZero
    # Single-thread copy from the page cache into pinned staging (a buffered pread): the RAM side of a miss.
    memcpy_gbps: GBps
    # DRAM read bandwidth the whole host reaches: what CPU copies (2 bytes of traffic per byte copied) and the
    # copy engines' DMA share (sim/machine/servers.py SharedBandwidth).
    dram_bandwidth_gbps: GBps
    # The most host RAM the GPU driver page-locks for one process where it is bounded (under WDDM mapped
    # page-locked memory is charged to the GPU's shared segment, about half the RAM): a larger region is refused
    # whole, and Strata then pins its expert arena layer slice by layer slice up to it (src/core/pinned.cu, #243).
    # Absent: no bound (Linux drivers pin the whole arena).
    gpu_pinnable_gib: GiBs | None = None

    # A host that exists: its OS leaves it some RAM, and it runs a thread per core at least (a profile whose
    # os_reserved_gib exceeded its ram_gib ran on, decode four times slower, without a word). The fields above are
    # validated first, so info.data holds ram_gib and hardware_threads here unless they were refused themselves.
    @field_validator("os_reserved_gib", mode="after")
    @classmethod
    def _below_the_ram(cls, reserved, info: ValidationInfo):
        ram = info.data.get("ram_gib")
        if ram is not None and reserved.value >= ram.value:
            raise ValueError(f"must be below host.ram_gib ({ram.value:g} GiB): the OS cannot hold all the RAM")
        return reserved

    @field_validator("physical_cores", mode="after")
    @classmethod
    def _at_most_the_threads(cls, cores, info: ValidationInfo):
        threads = info.data.get("hardware_threads")
        if threads is not None and cores.value > threads.value:
            raise ValueError(f"must be at most host.hardware_threads ({threads.value:g}): a core runs a thread "
                             "at least")
        return cores

    @property
    def own_ggml_kernel_types(self) -> frozenset[str]:
        """The GGML types whose kernel this host measured on itself (ggml_kernel_gbps' keys; the machine owns the
        rates)."""
        return frozenset(self.ggml_kernel_gbps or ())


class Unified(Strict):
    """One memory pool for CPU and GPU (GB10 / DGX Spark, Strix Halo, Apple M-series): the expert cache, the
    page cache and every process share host.ram_gib; a host -> device "copy" is a copy inside the pool."""

    gpu_allocatable_gib: GiBs  # the most of the pool the GPU may hold (GTT limit, recommendedMaxWorkingSetSize)
    copy_gbps: GBps  # bytes copied per second by a copy inside the pool
    copy_fixed_latency_us: Micros


class Pcie(Strict):
    link: str = Field(min_length=1)  # e.g. "PCIe 5.0 x16": description only
    h2d_pinned_gbps: GBps
    d2h_pinned_gbps: GBps
    h2d_pageable_gbps: GBps
    d2h_pageable_gbps: GBps
    # t(copy) = copy_fixed_latency_us + bytes / rate (hardware-and-gguf.md §0 rule 2)
    copy_fixed_latency_us: Micros


class Ssd(Strict):
    model: str = Field(min_length=1)
    read_request_kib: KiBs  # the request size the bandwidth table was measured or estimated at
    read_gbps_by_queue_depth: list[SsdPoint] = Field(min_length=1)
    request_latency_us: Micros  # one small (4 KiB) read at queue depth 1
    max_request_kib: KiBs  # larger reads are split into requests of at most this size

    @field_validator("read_gbps_by_queue_depth", mode="after")
    @classmethod
    def _increasing(cls, points: list) -> list:
        depths = [p.queue_depth for p in points]
        if depths != sorted(set(depths)):
            raise ValueError(f"queue depths must strictly increase, got {depths}")
        return points


class D2d(Strict):
    copy_gbps: GBps  # bytes copied per second (a read+write benchmark figure halved)


class Latency(Strict):
    memcpy_call_us: Micros  # host time of one small synchronous cudaMemcpy (enqueue + completion)
    device_sync_us: Micros  # cudaDeviceSynchronize / cudaStreamSynchronize after the work is done
    kernel_launch_us: Micros
    cuda_malloc_us: Micros
    cuda_malloc_us_per_gib: MicrosPerGiB
    cuda_free_us: Micros
    cuda_free_us_per_gib: MicrosPerGiB


class Compute(Strict):
    """GPU time per token and per routed layer for one model class (attention, shared and routed experts
    already resident on the GPU; transfers are simulated separately)."""

    # ds4's decode; Strata's decode is built from its parts (sim/engines/strata/decode.py), so its tables have none
    decode_us_per_token_layer: Micros | None = None
    prefill_us_per_token_layer: Micros
    # A batched prompt chunk's fixed cost per layer (kernel launches, per-chunk setup), on top of the
    # per-token cost: short chunks pay it over fewer tokens. Unset = 0, the per-token figure is all-in.
    prefill_us_per_chunk_layer: Micros | None = None


class HardwareProfile(Strict):
    name: str = Field(min_length=1)
    description: str = Field(min_length=1)
    os: Literal["linux", "windows", "macos"]  # windows means WDDM: slower and jittery RAM<->GPU transfers
    # discrete: a GPU with its own memory behind PCIe; unified: one pool for CPU and GPU ([unified] table)
    memory: Literal["discrete", "unified"] = "discrete"
    calibration: str | None = None  # path, relative to this file, of a GPU calibration file (expertsim calibrate)
    gpu: Gpu
    host: Host
    pcie: Pcie | None = None  # discrete memory only
    unified: Unified | None = None  # unified memory only
    ssd: Ssd
    d2d: D2d
    latency: Latency
    # Keyed by model class: a key matches every model whose name starts with it (longest key wins).
    compute: dict[str, Compute] = Field(min_length=1)

    _path: Path | None = PrivateAttr(default=None)
    _calibration_path: Path | None = PrivateAttr(default=None)
    _calibration_sha256: str | None = PrivateAttr(default=None)

    @property
    def path(self) -> Path | None:
        return self._path

    @property
    def calibration_path(self) -> Path | None:
        return self._calibration_path

    @property
    def calibration_sha256(self) -> str | None:
        return self._calibration_sha256

    @property
    def wddm(self) -> bool:
        return self.os == "windows"

    @model_validator(mode="after")
    def _memory_kind(self) -> "HardwareProfile":
        if self.memory == "discrete":
            missing = [key for key, v in (("gpu.vram_gib", self.gpu.vram_gib), ("[pcie]", self.pcie)) if v is None]
            if missing:
                raise ValueError(f"a discrete GPU needs {' and '.join(missing)}")
            if self.unified is not None:
                raise ValueError('[unified] belongs to memory = "unified" profiles only')
        else:
            if self.unified is None:
                raise ValueError('memory = "unified" needs a [unified] table')
            if self.gpu.vram_gib is not None or self.pcie is not None:
                raise ValueError('memory = "unified" has no gpu.vram_gib nor [pcie]: the pool is host.ram_gib')
            if self.unified.gpu_allocatable_gib.value > self.host.ram_gib.value:
                raise ValueError("unified.gpu_allocatable_gib exceeds the pool (host.ram_gib)")
        return self

    @property
    def is_unified(self) -> bool:
        return self.memory == "unified"

    @property
    def vram_bytes(self) -> int:
        """Device memory the GPU can hold: its VRAM, or on unified memory the share of the pool it may take."""
        if self.is_unified:
            return int(round(self.unified.gpu_allocatable_gib.value * GIB))
        return int(round(self.gpu.vram_gib.value * GIB))

    @property
    def runtime_reserved_bytes(self) -> int:
        return int(round(self.gpu.runtime_reserved_mib.value * MIB))

    @property
    def os_reserved_bytes(self) -> int:
        return int(round(self.host.os_reserved_gib.value * GIB))

    def copy_rates(self) -> dict:
        """Host <-> device copy figures, bytes/s and s: PCIe on a discrete card, a copy inside the pool on
        unified memory (pinned and pageable alike: there is no bus to cross)."""
        if self.is_unified:
            u = self.unified
            rate, lat = u.copy_gbps.value * 1e9, u.copy_fixed_latency_us.value * 1e-6
            return {"h2d_pinned": rate, "d2h_pinned": rate, "h2d_pageable": rate, "d2h_pageable": rate,
                    "latency_s": lat}
        c = self.pcie
        return {"h2d_pinned": c.h2d_pinned_gbps.value * 1e9, "d2h_pinned": c.d2h_pinned_gbps.value * 1e9,
                "h2d_pageable": c.h2d_pageable_gbps.value * 1e9, "d2h_pageable": c.d2h_pageable_gbps.value * 1e9,
                "latency_s": c.copy_fixed_latency_us.value * 1e-6}

    @property
    def ram_bytes(self) -> int:
        return int(round(self.host.ram_gib.value * GIB))

    def ssd_read_gbps(self, queue_depth: float) -> float:
        """Read bandwidth at `queue_depth`, linear between table points and flat beyond them."""
        points = [(p.queue_depth, p.value) for p in self.ssd.read_gbps_by_queue_depth]
        if queue_depth <= points[0][0]:
            return points[0][1]
        for (q0, b0), (q1, b1) in zip(points, points[1:]):
            if queue_depth <= q1:
                return b0 + (b1 - b0) * (queue_depth - q0) / (q1 - q0)
        return points[-1][1]

    def compute_key(self, model_name: str) -> str | None:
        matches = [key for key in self.compute if model_name.startswith(key)]
        return max(matches, key=len) if matches else None

    def compute_for(self, model_name: str) -> Compute | None:
        key = self.compute_key(model_name)
        return None if key is None else self.compute[key]

    def quantities(self) -> list[tuple[str, Quantity]]:
        """Every number of the profile with its dotted key path."""
        found: list[tuple[str, Quantity]] = []

        def visit(obj: object, path: str) -> None:
            if isinstance(obj, Quantity):
                found.append((path, obj))
            elif isinstance(obj, BaseModel):
                for name in type(obj).model_fields:
                    visit(getattr(obj, name), f"{path}.{name}" if path else name)
            elif isinstance(obj, dict):
                for key, item in obj.items():
                    visit(item, f"{path}.{key}")
            elif isinstance(obj, list):
                for i, item in enumerate(obj):
                    visit(item, f"{path}[{i}]")

        visit(self, "")
        return found

    def canonical(self) -> dict:
        """JSON-able content for hashing: the validated numbers, sources and the calibration's hash."""
        return {"profile": self.model_dump(mode="json"), "calibration_sha256": self.calibration_sha256}


# The GPU calibration file's identity (written by sim.calibrate.fileformat): a profile refuses a file of another
# schema or version when it loads, before any run reads its numbers.
CALIBRATION_SCHEMA = "expertsim-calibration"
CALIBRATION_SCHEMA_VERSION = 1


def check_calibration_header(path: Path, where: str) -> None:
    import json

    try:
        record = json.loads(read_bytes(path, where))
    except (ValueError, UnicodeDecodeError):
        raise InputError(where, "path", str(path), "not a JSON calibration file") from None
    if not isinstance(record, dict) or record.get("schema") != CALIBRATION_SCHEMA:
        raise InputError(where, "schema", record.get("schema") if isinstance(record, dict) else None,
                         f"not an {CALIBRATION_SCHEMA} file")
    if record.get("schema_version") != CALIBRATION_SCHEMA_VERSION:
        raise InputError(where, "schema_version", record.get("schema_version"),
                         f"this expertsim reads version {CALIBRATION_SCHEMA_VERSION}")


def _is_bare_name(ref: str) -> bool:
    return "/" not in ref and "\\" not in ref and not ref.endswith(".toml")


def hardware_search_dirs(start: Path) -> list[Path]:
    """Folders a bare profile name is looked up in: `hardware/` and `scenarios/hardware/` in `start` and
    every folder above it, then the repository's own scenarios/hardware/."""
    dirs: list[Path] = []
    for folder in (start, *start.parents):
        dirs += [folder / "hardware", folder / "scenarios" / "hardware"]
    dirs.append(REPO_SCENARIOS / "hardware")
    return list(dict.fromkeys(dirs))


def resolve_hardware(ref: str, base: Path, where: str, field: str = "hardware") -> Path:
    safe_path(where, field, ref)
    if _is_bare_name(ref):
        for folder in hardware_search_dirs(base):
            candidate = folder / f"{ref}.toml"
            if is_file(candidate):
                return candidate
        raise InputError(where, field, ref, f"no hardware profile {ref}.toml in scenarios/hardware/ next to or "
                                            f"above {base} (or give a path to a .toml file)")
    path = Path(ref)
    path = path if path.is_absolute() else base / path
    if not is_file(path):
        raise InputError(where, field, ref, f"no such file ({path})")
    return path


def load_hardware(ref: str | Path, *, base: str | Path | None = None) -> HardwareProfile:
    """A profile by bare name (scenarios/hardware/NAME.toml, looked up from `base` or the working folder
    upward, then in this repository) or by path (relative to `base`, or absolute)."""
    base_dir = Path(base) if base is not None else Path.cwd()
    path = resolve_hardware(str(ref), base_dir, str(ref), "hardware")
    return load_hardware_file(path.resolve())


def load_hardware_file(path: Path) -> HardwareProfile:
    """The profile in the file `path`. Parsing is cached by content; each call returns its own copy, and the
    calibration file (if any) is hashed afresh."""
    where = display_path(path)
    profile = _parse_profile(where, read_bytes(path, where)).model_copy()
    profile._path = path
    if profile.calibration is not None:
        safe_path(where, "calibration", profile.calibration)
        cal = Path(profile.calibration)
        cal = cal if cal.is_absolute() else path.parent / cal
        if not is_file(cal):
            raise InputError(where, "calibration", profile.calibration, f"no such file ({cal})")
        check_calibration_header(cal, f"{where}: calibration")  # another schema version is an error here
        profile._calibration_path = cal.resolve()
        profile._calibration_sha256 = sha256_file(cal)
    return profile


@lru_cache(maxsize=64)
def _parse_profile(where: str, raw: bytes) -> HardwareProfile:
    data = parse_toml(raw, where)
    if "name" not in data:
        data = {"name": Path(where).stem, **data}
    profile = validate(where, HardwareProfile, data)
    if "" in profile.compute:
        raise InputError(where, "compute", "", "a model class key must not be empty")
    return profile


def find_profiles(start: Path) -> list[Path]:
    """Every profile a bare name can reach from `start` (hardware_search_dirs), first-found wins per name."""
    found: dict[str, Path] = {}
    for folder in hardware_search_dirs(start):
        for path in sorted(folder.glob("*.toml")) if folder.is_dir() else []:
            found.setdefault(path.stem, path)
    return list(found.values())


def profile_summary(profile: HardwareProfile) -> dict:
    """One line of `expertsim hardware list`: the figures that decide a cache's size and its refill rate."""
    fastest = profile.ssd.read_gbps_by_queue_depth[-1]
    return {"name": profile.name, "os": profile.os, "memory": profile.memory, "gpu": profile.gpu.model,
            "vram_gib": profile.gpu.vram_gib.value if profile.gpu.vram_gib is not None else None,
            "ram_gib": profile.host.ram_gib.value, "ssd_gbps": fastest.value,
            "h2d_pinned_gbps": profile.pcie.h2d_pinned_gbps.value if profile.pcie is not None else None,
            "calibrated": profile.calibration is not None,
            "path": display_path(profile.path) if profile.path else None}


# Figures that are counts: a sample's value is rounded (sim/explore/uncertainty.py draws them as reals).
INTEGER_INPUTS = ("host.hardware_threads", "host.physical_cores")
SSD_TABLE = "ssd.read_gbps_by_queue_depth"  # its points must keep rising with the queue depth: one factor for all


def with_values(profile, values: dict[str, float]):
    """The profile with some figures replaced (dotted keys as `quantities()` names them; SSD_TABLE + "[*]" scales
    the whole queue-depth table by one factor), revalidated: an uncertainty sample's profile."""
    data = profile.model_dump()
    for path, value in values.items():
        if path == SSD_TABLE + "[*]":
            for point in data["ssd"]["read_gbps_by_queue_depth"]:
                point["value"] *= float(value)
            continue
        if path.startswith("compute."):  # a model class key may hold dots itself (qwen3.8-flash-next)
            key, field = path[len("compute."):].rsplit(".", 1)
            target = data["compute"][key][field]
        else:
            node = data
            parts = path.replace("]", "").replace("[", ".").split(".")
            for part in parts[:-1]:
                node = node[int(part)] if isinstance(node, list) else node[part]
            target = node[int(parts[-1])] if isinstance(node, list) else node[parts[-1]]
        target["value"] = int(value) if path in INTEGER_INPUTS else float(value)
    changed = HardwareProfile.model_validate(data)
    for attr in ("_path", "_calibration_path", "_calibration_sha256"):
        setattr(changed, attr, getattr(profile, attr))
    return changed


def profile_figures(profile: HardwareProfile) -> list[dict]:
    """Every sourced figure of a profile as rows (key, value, unit, source), in the file's order."""
    rows: list[dict] = []

    def walk(prefix: str, node) -> None:
        if isinstance(node, dict) and {"value", "unit", "source"} <= set(node):
            rows.append({"key": prefix, "value": node["value"], "unit": node["unit"], "source": node["source"],
                         "range": node.get("range")})
        elif isinstance(node, dict):
            for k, v in node.items():
                walk(f"{prefix}.{k}" if prefix else k, v)
        elif isinstance(node, list):
            for i, v in enumerate(node):
                walk(f"{prefix}.{i}", v)
        elif node is not None:
            rows.append({"key": prefix, "value": node, "unit": None, "source": None, "range": None})

    walk("", profile.model_dump(exclude_none=True))
    return rows


__all__ = [
    "Compute", "GIB", "HardwareProfile", "INTEGER_INPUTS", "MIB", "Quantity", "SSD_TABLE", "find_profiles", "is_file",
    "load_hardware", "load_hardware_file", "profile_figures", "profile_summary", "quantity", "resolve_hardware",
    "validate", "with_values",
]
