"""llama.cpp's knobs and plan's default search: how many MoE layers' experts sit in host RAM (--n-cpu-moe) and the
prompt's physical batch (-ub), the question every user of a card too small for the model asks (the reference's §9);
then the host buffer kind and op offload, one at a time."""

from __future__ import annotations

from sim.engines.base import Knob, SearchAxis, candidates, setting
from sim.engines.llamacpp.settings import (DEFAULT_UBATCH_TOKENS, KEY_LOAD_MODE, KEY_NCMOE, KEY_NGL,
                                           KEY_NO_OP_OFFLOAD, KEY_UBATCH, KEY_VARIANT)

KNOBS = (
    Knob(KEY_NCMOE, "MoE layers on the CPU", "layers", labels={0: "n-cpu-moe=0 (no override: --fit places)"}),
    Knob(KEY_UBATCH, "prompt ubatch", "tokens"),
    Knob(KEY_LOAD_MODE, "load mode", labels={"auto": "file mapping (auto)", "none": "pinned buffer (none)",
                                             "mmap+mlock": "mlocked mapping"}),
    Knob(KEY_NO_OP_OFFLOAD, "no op offload", labels={True: "CPU prompt experts", False: "op offload"}),
    Knob(KEY_VARIANT, "variant", labels={"mainline": "llama.cpp", "ik": "ik_llama.cpp",
                                         "mainline-pre-15346": "llama.cpp before #15346"}),
    # whole layers on the GPU: swept by hand (sweep --grid engine.flags.n-gpu-layers=...), not in plan's search, whose
    # question is which experts leave the card (-ngl moves attention and every weight of a layer with them)
    Knob(KEY_NGL, "layers on the GPU (-ngl)", "layers"),
)


def layer_candidates(n_layers: int) -> list[int]:
    """Every MoE layer on the CPU, three quarters, half, a quarter, none."""
    return sorted({n_layers, 3 * n_layers // 4, n_layers // 2, n_layers // 4, 0}, reverse=True)


def search_space(data: dict, n_layers: int) -> list[SearchAxis]:
    own_layers = setting(data, KEY_NCMOE)
    own_ubatch = setting(data, KEY_UBATCH)
    variant = setting(data, KEY_VARIANT) or "mainline"
    axes = [SearchAxis(KNOBS[0], candidates(own_layers, *layer_candidates(n_layers)), True),
            SearchAxis(KNOBS[1], candidates(own_ubatch, DEFAULT_UBATCH_TOKENS, 1024, 2048, 4096), True)]
    if variant != "ik":
        axes.append(SearchAxis(KNOBS[2], candidates(setting(data, KEY_LOAD_MODE), "auto", "none"), False))
    axes.append(SearchAxis(KNOBS[3], candidates(setting(data, KEY_NO_OP_OFFLOAD), False, True), False))
    return axes
