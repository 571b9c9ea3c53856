"""llama.cpp's memory at load, in the order it allocates (the reference's §2.2, §5.1, §6): the runtime, the weights on
the GPU (non-expert tensors and the expert tensors nobody overrode to the CPU), the K/V cache of the context, and
the compute buffer; in host RAM, the CPU experts when they are read into a buffer (--load-mode none: pinned, or
plain RAM with GGML_CUDA_NO_PINNED; ik_llama.cpp's default). In the file mapping (mainline's default) they are
page-cache pages: no allocation.

The GPU refusing an allocation is llama.cpp's refusal to load ("CUDA error: out of memory"): the plan says why
(plan prunes such a placement) and the run refuses to start. A pinned buffer larger than the RAM available fails
the load too (ollama #11772: pinning 15 GB of experts failed with CUDA out of memory): refused with the scenario.
"""

from __future__ import annotations

from dataclasses import dataclass

from sim.engines.base import Allocation, MemoryPlan
from sim.engines.llamacpp.settings import KEY_NCMOE, Knobs
from sim.engines.llamacpp.vram import part_bytes, vram_allocations
from sim.errors import InputError
from sim.units import GIB

HOST_WORDS = {"mapped": "file mapping, pageable", "pinned": "pinned CUDA_Host buffer", "ram": "pageable RAM buffer"}


@dataclass(frozen=True)
class LlamaMemory(MemoryPlan):
    cpu_expert_bytes: int = 0  # every expert slice in host memory


def plan_memory(scenario, knobs: Knobs, where: str) -> LlamaMemory:
    layout, profile = scenario.layout, scenario.hardware_profile
    parts = part_bytes(layout) * layout.n_experts
    cpu_bytes = int(parts[knobs.on_cpu].sum())
    gpu_expert_bytes = int(parts[~knobs.on_cpu].sum())
    allocations = vram_allocations(layout, profile, knobs.on_cpu, knobs.ctx, knobs.ubatch, knobs.op_offload, where)
    vram_used = sum(a.bytes for a in allocations)
    why = None
    if vram_used > profile.vram_bytes:
        why = (f"llama.cpp would fail to load: CUDA error: out of memory ({vram_used / GIB:.2f} GiB of "
               f"{profile.vram_bytes / GIB:.2f} GiB): put more expert layers on the CPU (--n-cpu-moe), or lower "
               "--ctx-size / --ubatch-size")
    if knobs.host != "mapped" and cpu_bytes:
        kind = "pinned CUDA_Host" if knobs.pinned else "pageable RAM"
        allocations.append(Allocation("ram", f"CPU experts ({kind})", cpu_bytes))
        available = profile.ram_bytes - profile.os_reserved_bytes
        if cpu_bytes > available:
            failure = "fails (CUDA out of memory)" if knobs.pinned else "fails (out of memory)"
            raise InputError(where, "engine.flags", f"CPU experts in {kind}",
                             f"llama.cpp would fail to load: reading {cpu_bytes / GIB:.2f} GiB of experts into "
                             f"{kind} {failure} with {available / GIB:.2f} GiB of RAM available: keep the file "
                             "mapping (mainline's default; GGML_CUDA_NO_PINNED=1 on ik_llama.cpp)")
    return LlamaMemory(tuple(allocations), profile.vram_bytes - vram_used, why, KEY_NCMOE,
                       notices=(f"experts in host memory: {cpu_bytes / GIB:.2f} GiB ({HOST_WORDS[knobs.host]}), "
                                f"on the GPU: "
                                f"{gpu_expert_bytes / GIB:.2f} GiB",),
                       cpu_expert_bytes=cpu_bytes)
