"""How fast one CPU core runs ggml's dequantize-and-dot kernels over expert weights (the CPU's mul_mat_id, §3.1),
per GGML type and instruction set: llama.cpp's own kernels, not the profile's expert-kernel figure (that is Strata's
pool, sim/hardware.py Host.expert_kernel_gbps).

The figures are measured (records llamacpp-<build>-<isa>-<type>, sim/engines/records.py): llama-bench decode of
synthetic Qwen3-30B-A3B-shaped models on one thread, the experts of every layer requantized to one type, the time of 8
layers taken as the difference of a 16-layer and an 8-layer model. Two builds: mainline llama.cpp's ggml ("ggml") and
ik_llama.cpp's own kernels ("ik", the ik variant's). A type with no measurement of its own takes the measured kernel
of its family [E: the family's kernels share their inner loop]; the machine caps a layer's rate by the cores and the
DRAM it shares (sim/machine Machine.cpu_expert_matmul). They are one Zen 4 core's: another CPU's cores run at
another rate, which every run's out_of_domain says (docs/calibration.md), unless the profile holds its own host's
figures (host.ggml_kernel_gbps, measured there with the same command).
"""

from __future__ import annotations

from sim.engines.records import BUILD_NAMES, GGML_KERNEL_GBPS, ggml_kernel_record_id

# the measured kernel whose rate a type takes: itself, or its family's
MEASURED_AS = {
    "Q8_0": "Q8_0", "Q6_0": "Q8_0",
    "Q4_0": "Q5_0", "Q4_1": "Q5_0", "Q5_0": "Q5_0", "Q5_1": "Q5_0",
    "Q2_K": "Q4_K", "Q3_K": "Q4_K", "Q4_K": "Q4_K", "Q5_K": "Q4_K", "Q6_K": "Q6_K",
    "MXFP4": "MXFP4",
    "IQ4_NL": "IQ4_XS", "IQ4_XS": "IQ4_XS",
    "IQ1_S": "IQ3_S", "IQ1_M": "IQ3_S", "IQ2_XXS": "IQ3_S", "IQ2_XS": "IQ3_S", "IQ2_S": "IQ3_S", "IQ3_XXS": "IQ3_S",
    "IQ3_S": "IQ3_S",
    # ik_llama.cpp's own types (only its build loads them): the row-scaled KS types, and the IQn_K family
    "IQ2_KS": "IQ2_KS", "IQ2_KL": "IQ2_KS", "IQ3_KS": "IQ3_KS", "IQ4_KS": "IQ4_KS", "IQ5_KS": "IQ5_KS",
    "IQ2_K": "IQ4_K", "IQ3_K": "IQ4_K", "IQ4_K": "IQ4_K", "IQ5_K": "IQ4_K", "IQ6_K": "IQ4_K",
}

# the instruction sets with measured kernels (the profile's host.simd picks one; NEON has none)
MEASURED_ISAS = frozenset(isa for _, isa, _ in GGML_KERNEL_GBPS)


def measured_kernel(build: str, isa: str | None, type_name: str) -> tuple[str, str] | None:
    """(build, type) of the measured kernel one slice runs at: the build's own measurement of the type, else of its
    family's (MEASURED_AS); ik_llama.cpp's kernels where measured, else mainline ggml's [E: a type ik was not measured
    on; measured, ik's kernels run at 0.35x (MXFP4) to 1.4x (Q8_0) mainline's]; None where neither has one."""
    family = MEASURED_AS.get(type_name)
    for candidate in dict.fromkeys((build, "ggml")):
        for measured in dict.fromkeys((type_name, family)):
            if (candidate, isa, measured) in GGML_KERNEL_GBPS:
                return candidate, measured
    return None


def host_rate(own_kernel, type_name: str) -> float | None:
    """One core of this host in mainline ggml's kernel for the type, or its family's, bytes/s, where the profile
    measured it (own_kernel: the machine's own_ggml_kernel); None where it has neither."""
    if own_kernel is None:
        return None
    for measured in dict.fromkeys((type_name, MEASURED_AS.get(type_name))):
        rate = None if measured is None else own_kernel(measured)
        if rate is not None:
            return rate
    return None


def slice_kernel(build: str, isa: str | None, type_name: str, own_kernel=None) -> tuple | None:
    """What one slice of a type runs at: ("host", bytes/s) where the profile measured its own host's rate (mainline's
    kernels, and an ik slice that ik's own records lack; own_kernel: the machine's own_ggml_kernel), ("record",
    build, measured type) for a measured kernel's record, None where neither has one."""
    kernel = measured_kernel(build, isa, type_name)
    ik_own = kernel is not None and kernel[0] == build != "ggml"  # ik's own measured kernel
    on_host = None if ik_own else host_rate(own_kernel, type_name)
    if on_host is not None:
        return "host", on_host
    return None if kernel is None else ("record", *kernel)


def kernel_records(part_types, isa: str | None, build: str = "ggml", own_kernel=None) -> set[str]:
    """The kernel records slices of these types read (slice_kernel): the engine's records_read."""
    found = (slice_kernel(build, isa, str(t), own_kernel) for t in part_types)
    return {ggml_kernel_record_id(k[1], isa, k[2]) for k in found if k is not None and k[0] == "record"}


def expert_core_rate(part_bytes, part_types, isa: str | None, domain, notices: list[str],
                     build: str = "ggml", own_kernel=None) -> float | None:
    """One core's rate over one expert's slices (gate, up, down: bytes and types), bytes per second: the bytes over
    the sum of each slice's time at its kernel's rate (build: "ggml" for mainline, "ik" for ik_llama.cpp;
    slice_kernel says which). None where a slice's type or the profile's instruction set has no measurement: the
    machine's own expert-kernel figure then, said in a notice."""
    seconds = 0.0
    for n_bytes, type_name in zip(part_bytes, part_types):
        kernel = slice_kernel(build, isa, str(type_name), own_kernel)
        if kernel is None:
            why = (f"no measured ggml CPU kernels for host.simd {isa or '(not set)'}" if isa not in MEASURED_ISAS
                   else f"no measured ggml CPU kernel for {type_name}")
            _notice(notices, f"{why}: the CPU expert matmul runs at the profile's host.expert_kernel_gbps per core")
            return None
        if kernel[0] == "host":
            seconds += n_bytes / kernel[1]
            continue
        _, kernel_build, measured = kernel
        if kernel_build != build:
            _notice(notices, f"no measured {BUILD_NAMES[build]} CPU kernel for {type_name} on {isa}: mainline "
                             f"ggml's {measured} kernel stands in")
        r = domain.use(ggml_kernel_record_id(kernel_build, isa, measured),
                       f"{BUILD_NAMES[kernel_build]}'s {measured} kernel on one {isa} core")
        seconds += n_bytes / (r.value * 1e9)
    return float(sum(part_bytes)) / seconds


def _notice(notices: list[str], note: str) -> None:
    """A run's notice, once however many layers and slices meet it."""
    if note not in notices:
        notices.append(note)
