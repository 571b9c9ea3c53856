"""ds4's total expert budget planner of the later builds (ds4.c @54b36ed, PR #488, PR #1036), as pure functions.

Later upstream sizes one total expert budget before anything is allocated (ds4.c @54b36ed
ds4_engine_configure_streaming_cache_budget, ds4_ssd.c ds4_ssd_auto_cache_plan): the working set R is Metal's
recommendedMaxWorkingSetSize, or the device's total memory (hipMemGetInfo on ROCm, the GTT pool on an APU;
cudaMemGetInfo with #488). A budget in GiB is capped to the graph working-set pressure budget; no budget on
Metal/ROCm (and CUDA with #488) is the auto budget; then two layers of prefill headroom come off the top.
"""

from __future__ import annotations

from dataclasses import dataclass

from sim.engines.ds4.settings import KEY_BUDGET
from sim.errors import InputError
from sim.units import GIB, MIB


AUTO_CACHE_PCT = 80                                # DS4_SSD_AUTO_CACHE_PCT default (ds4_ssd.c @54b36ed)
GRAPH_PRESSURE_SHARE = (7, 8)                      # the manual cap: 7/8 of R less the context's memory
PREFILL_HEADROOM_LAYERS = 2                        # DS4_STREAMING_PREFILL_HEADROOM_LAYERS (ds4.c @54b36ed L4506)
V41_RUNTIME_ALLOWANCE_BYTES = 2 * GIB              # "2.00 GiB runtime/I/O allowance" (the #1036 log)


def graph_pressure_cap_bytes(working_set: int, context_bytes: int) -> int:
    """ds4_streaming_manual_cache_safe_bytes (ds4.c @54b36ed L4627-4661): floor_GiB(R x 7/8 - the context's
    memory), at least 1 GiB ("budget X GiB capped to Y GiB to stay below the graph working-set pressure budget")."""
    num, den = GRAPH_PRESSURE_SHARE
    return max(GIB, (working_set * num // den - context_bytes) // GIB * GIB)


@dataclass(frozen=True)
class BudgetPlan:
    cache_experts: int  # the count handed to the expert cache: the planner's dynamic experts, or the auto count
    headroom_bytes: int  # two layers of prefill staging held inside a byte budget (0: none)
    notices: tuple[str, ...]


def _one_expert_at_least(n_bytes: int, expert_size: int, cacheable: int) -> int:
    return max(1, min(n_bytes // expert_size, cacheable))


def budget_plan(mode: str, *, api: str, working_set: int, requested_bytes: int | None,
                requested_experts: int | None, expert_size: int, n_experts: int, cacheable_layers: int, non_routed: int,
                context_bytes: int, fixed_bytes: int = 0, where: str = "ds4 budget planner",
                field: str = KEY_BUDGET) -> BudgetPlan:
    """The expert budget of the later builds (see the section above). mode: "auto-488" (#488: the auto count; only
    asked when no budget is given, a given one being the live path's), "planner" (@54b36ed) or "planner-v41"
    (#1036); requested_bytes:
    the CLI's NGB, requested_experts its N (a count gets no cap and no headroom split: ds4.c L53827); api: the
    profile's GPU interface (the auto budget is Metal's and ROCm's, and CUDA's with #488); fixed_bytes: for the
    V4.1 fit, the static weights and graph the working set also holds; expert_size and cacheable_layers: the
    dominant routed size (most layers) and the layers of that size (ds4_streaming_routed_expert_bytes,
    ds4_streaming_cacheable_expert_count @54b36ed). Raises the engine's startup refusals."""
    cacheable = cacheable_layers * n_experts
    notices: list[str] = []
    if requested_experts is not None:
        return BudgetPlan(min(requested_experts, cacheable), 0, ())
    if requested_bytes is not None:
        total = requested_bytes
        cap = graph_pressure_cap_bytes(working_set, context_bytes)
        if total > cap:
            notices.append(f"SSD streaming cache budget {total / GIB:.2f} GiB capped to {cap / GIB:.2f} GiB to "
                           "stay below the graph working-set pressure budget")
            total = cap
    elif api in ("metal", "hip") or mode == "auto-488":
        target = working_set * AUTO_CACHE_PCT // 100
        experts = _one_expert_at_least(max(0, target - non_routed), expert_size, cacheable)
        total = experts * expert_size
        notices.append(f"SSD streaming auto cache budget: {api} recommends {working_set / GIB:.2f} GiB working set; "
                       f"{AUTO_CACHE_PCT} % = {target / GIB:.2f} GiB for model + cached experts, non-routed weights "
                       f"{non_routed / GIB:.2f} GiB; expert budget {experts} ({total / GIB:.2f} GiB)"
                       + ("; non-routed weights already fill the target: a one-expert cache"
                          if target <= non_routed else ""))
        if mode == "auto-488":
            return BudgetPlan(experts, 0, tuple(notices))
    else:  # a CUDA build of @54b36ed has no auto budget (ds4.c L405-413): no cache is planned
        return BudgetPlan(0, 0, ("no expert budget given: this CUDA build plans no expert cache "
                                 "(its auto budget is Metal's and ROCm's)",))
    headroom = min(PREFILL_HEADROOM_LAYERS, cacheable_layers) * n_experts * expert_size
    if headroom >= total:
        raise InputError(where, field, f"{total / GIB:.2f} GiB",
                         f"ds4 refuses it: byte budget {total / GIB:.2f} GiB is too small: routed prefill headroom "
                         f"needs {headroom / GIB:.2f} GiB")
    dynamic = min((total - headroom) // expert_size, cacheable)
    if dynamic == 0:
        raise InputError(where, field, f"{total / GIB:.2f} GiB",
                         "ds4 refuses it: byte budget is too small or invalid for this model")
    notices.append(f"{api} SSD streaming total expert budget {total / GIB:.2f} GiB = {headroom / GIB:.2f} GiB prefill "
                   f"headroom + {dynamic * expert_size / GIB:.2f} GiB dynamic cache ({dynamic} experts, "
                   f"{expert_size / MIB:.2f} MiB each)")
    if mode == "planner-v41":
        room = working_set - fixed_bytes - headroom - V41_RUNTIME_ALLOWANCE_BYTES
        fitted = max(0, min(dynamic, room // expert_size))
        if fitted == 0:
            raise InputError(where, field, f"{total / GIB:.2f} GiB",
                             "ds4 refuses it: no dynamic cache fits beside the static weights, staging, graph and "
                             "the runtime/I/O allowance")
        if fitted < dynamic:
            notices.append(f"V4.1 SSD cache fitted from {dynamic} to {fitted} experts for context/runtime headroom")
        dynamic = fitted
    return BudgetPlan(int(dynamic), headroom, tuple(notices))

