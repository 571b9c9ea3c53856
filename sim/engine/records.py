"""Calibration records: every figure of an engine model that was fitted from a measurement.

A record is keyed by the run it was fitted on: (engine, model, hardware, context). A scenario whose engine,
model (by prefix), hardware profile or context differs still gets the figure (there is no better one),
but the run lists the record under `out_of_domain` in its summary, with the key parts that differ, so a
result built on a figure from another box never looks like a prediction for this one. Hardware-profile
figures that were fitted or derived from such a run name their record (`record = "..."` in the profile's
quantity table) and are checked the same way.

`case` names the validation case the record was fitted from (scenarios/validation/, docs/validation.md):
a case with any record is a calibration case, every other case a prediction case.
"""

from __future__ import annotations

from dataclasses import dataclass

from sim.units import GIB, MIB


@dataclass(frozen=True)
class Record:
    id: str
    figure: str  # what the engine model reads
    value: float
    unit: str
    engine: str
    model: str  # a model-name prefix
    hardware: str  # a hardware profile name
    context: int | None  # the run's context length (tokens), where the figure depends on it
    case: str  # the validation case the figure was fitted from
    source: str  # what the figure was fitted on, and how

    def key_differences(self, engine: str, model: str, hardware: str, context: int | None) -> list[str]:
        """The parts of this record's key a run does not share (empty: in domain)."""
        out = []
        if engine != self.engine:
            out.append(f"engine {engine} (fitted on {self.engine})")
        if not model.startswith(self.model):
            out.append(f"model {model} (fitted on {self.model})")
        if hardware != self.hardware:
            out.append(f"hardware {hardware} (fitted on {self.hardware})")
        if self.context is not None and context is not None and context != self.context:
            out.append(f"context {context} (fitted at {self.context})")
        return out

    def bytes(self) -> int:
        scale = {"GiB": GIB, "MiB": MIB, "B": 1}[self.unit]
        return int(round(self.value * scale))


RECORDS: tuple[Record, ...] = (
    # ds4, DeepSeek-V4-Flash on the #503 box. ds4 printed "available 81.57 GiB" (ds4-engine.md §1.12) with the
    # q2-q4 file at --ctx 32768 on the 96 GB card, whose CUDA total is 94.97 GiB: VRAM before the cache =
    # 13.40 GiB. Of that the model derives the non-routed weights (8.20 GiB, antirez/ds4#488), the KV cache
    # and the prefill context buffers at that context and chunk (ds4_plan.flash_kv_bytes and
    # flash_context_buffer_bytes: 0.7770 + 0.2501 GiB; the formula gives ds4's own "context buffers" figure to
    # the byte at two other contexts, tests/test_ds4_plan.py) and the driver's own reservation (555 MiB, the
    # profile's gpu.runtime_reserved_mib);
    # what is left is ds4's compute buffers and scratch, fitted here.
    Record("ds4-flash-buffers-503", "compute_buffers", 3.6309, "GiB", "ds4", "deepseek-v4-flash",
           "rtx-pro-6000-96gb", 32768, "seed-504",
           "94.97 GiB CUDA total - 81.57 GiB available (#503 log) - 8.20 GiB non-routed - 0.7770 GiB KV - 0.2501 GiB "
           "context buffers at --ctx 32768, chunk 4096 - 0.542 GiB runtime reserved (rtx-pro-6000-96gb.toml)"),
    # ds4 (neutronstar GLM stack), GLM-5.2 on the 16 GB RTX 4060 Ti rig: "the resident weights want ~9-13
    # GiB VRAM plus ~8 GiB pinned host RAM" (giannisanni/neutronstar README). The upper 13 GiB is everything
    # before the expert cache; less the derived non-routed weights on the GPU (18.70 - 8 GiB), the f32 MLA
    # cache at --ctx 4096 (0.69 GiB) and the runtime reservation (107 MiB), the rest is buffers.
    Record("ds4-glm52-buffers-neutronstar", "compute_buffers", 1.5139, "GiB", "ds4", "glm-5.2",
           "rtx-4060ti-16gb", 4096, "seed-504-glm52",
           "13 GiB resident VRAM (neutronstar README) - 10.696 GiB non-routed on the GPU - 0.6855 GiB MLA cache at "
           "--ctx 4096 - 0.1045 GiB runtime reserved (rtx-4060ti-16gb.toml)"),
    # ds4's graph encode per decode token on the main thread, before the GPU runs the layer: "encode=9.8-10.6 ms
    # execute=45.0-45.7 ms ... total=55.0-56.0 ms" (DS4_METAL_GRAPH_TOKEN_PROFILE=1, antirez/ds4#773, GB10, q2
    # Flash): serial with the kernels. CPU work: its figure on another CPU is not known.
    Record("ds4-graph-encode-773", "graph_encode_ms_per_token", 10.2, "ms", "ds4", "deepseek-v4-flash",
           "dgx-spark-gb10", None, "D11", "the midpoint of encode = 9.8-10.6 ms per token (#773's token profile)"),
    # Strata, Qwen3.8-Flash-Next IQ3_S on the #658 box: the auto cache held 10,222 slots (seed) at reserve 1536
    # MiB with borrowing; with the scenarios' ranking any free VRAM at sizing in [21,503.19, 21,505.73) MiB gives
    # 10,222 (strata_plan.auto_cache_free_vram_range; tests/test_strata_engine.py checks it), we take 21,504.
    # Free = 32 GiB - runtime reserved - INT8 K/V of the 12 QSA layers and the draft layer at 262,144
    # (strata_plan.kv_vram_bytes) - weights and buffers: the last term is fitted.
    Record("strata-658-weights-buffers", "vram_weights_buffers", 7330.0, "MiB", "strata", "qwen3.8-flash-next",
           "rtx-5090-48gb-windows", 262144, "seed-658",
           "32,768 MiB - 21,504 MiB free at sizing (auto cache 10,222 slots) - 3,432 MiB INT8 K/V (13 layers x "
           "1,056 B x 262,144) - 502 MiB runtime reserved (rtx-5090-48gb-windows.toml)"),
    # The #658 box's effective host -> device rate under WDDM: strata-engine.md §6 gives "PCIe B ~ 16 GB/s
    # effective on the 5090" with no derivation; it may come from the #658 runs, so it is recorded as fitted
    # there (the hardware profile's pcie.h2d_pinned_gbps names this record).
    Record("strata-658-h2d", "pcie.h2d_pinned_gbps", 16.0, "GB/s", "strata", "qwen3.8-flash-next",
           "rtx-5090-48gb-windows", None, "seed-658", "strata-engine.md §6, effective PCIe on the #658 box"),
    # Strata's decode on the #658 box: the median of eight 512-token decode runs, 116.9 tok/s (strata-engine.md
    # §5.1), an all-in figure (MTP verify windows, the CPU/PCIe handling of misses) at that box's cache.
    Record("strata-658-decode", "decode_us_per_token_layer", 178.2, "us", "strata", "qwen3.8-flash-next",
           "rtx-5090-48gb-windows", 262144, "seed-658",
           "8.55 ms per token (116.9 tok/s, median of the #658 decode runs) / 48 layers"),
    # Strata's decode-window reading of a short part (<= --short-read tokens): "about 16 ms/token" (strata-engine.md
    # §3.3, a comment in generate.cpp, validation case S7); the box it was measured on is not named.
    Record("strata-short-read", "short_read_ms_per_token", 16.0, "ms", "strata", "qwen3.8-flash-next",
           "not reported", None, "S7", "generate.cpp comment: a decode window of a short part ~16 ms per token"),
    # Strata's prompt compute on a 5090: c ~ 0.19 ms/token (strata-engine.md §6, no derivation given; it may
    # come from the #658 runs, so it is recorded as fitted there).
    Record("strata-658-prefill", "prefill_us_per_token_layer", 3.958, "us", "strata", "qwen3.8-flash-next",
           "rtx-5090-48gb-windows", None, "seed-658", "0.19 ms per token / 48 layers (strata-engine.md §6)"),
)

BY_ID = {r.id: r for r in RECORDS}


def record(record_id: str) -> Record:
    return BY_ID[record_id]


class Domain:
    """The out_of_domain notes of one run: which records it used outside their key."""

    def __init__(self, engine: str, model: str, hardware: str, context: int | None):
        self.key = (engine, model, hardware, context)
        self.notes: dict[str, str] = {}

    def use(self, record_id: str, what: str | None = None) -> Record:
        r = BY_ID[record_id]
        diff = r.key_differences(*self.key)
        if diff:
            self.notes[f"{r.id}:{what or r.figure}"] = \
                f"{what or r.figure} = {r.value:g} {r.unit} (record {r.id}): " + "; ".join(diff)
        return r

    def use_profile_figure(self, path: str, quantity) -> float:
        """A hardware-profile figure; if it names a record (fitted there, or derived from it), check that
        record's key too."""
        if getattr(quantity, "record", None):
            r = BY_ID[quantity.record]
            diff = r.key_differences(*self.key)
            if diff:
                self.notes[f"{r.id}:{path}"] = (f"{path} = {quantity.value:g} {quantity.unit} (from record {r.id}, "
                                                f"{r.value:g} {r.unit}): " + "; ".join(diff))
        return quantity.value

    def use_profile(self, profile, compute_key: str | None) -> None:
        """Every figure of the hardware profile a run reads: the machine's (all but [compute]) and the compute
        table of the scenario's model class."""
        own_compute = f"compute.{compute_key}."
        for path, quantity in profile.quantities():
            if not path.startswith("compute.") or path.startswith(own_compute):
                self.use_profile_figure(path, quantity)

    def out_of_domain(self) -> list[str]:
        return [self.notes[k] for k in sorted(self.notes)]
