"""Model layouts: which layers hold routed experts and how many bytes each expert takes."""

from sim.model.gguf_reader import GgufModel, layout_from_gguf, read_gguf
from sim.model.layout import ExpertLayer, ModelLayout, SizeClasses
from sim.model.presets import PRESETS, get_preset, preset_names
from sim.model.quant import QUANT_TYPES, QuantType, quant_type, tensor_bytes

__all__ = [
    "PRESETS", "QUANT_TYPES", "ExpertLayer", "GgufModel", "ModelLayout", "QuantType", "SizeClasses",
    "get_preset", "layout_from_gguf", "preset_names", "quant_type", "read_gguf", "tensor_bytes",
]
