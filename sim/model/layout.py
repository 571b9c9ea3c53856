"""Where the routed experts of a MoE model live, and how many bytes each one is.

A `ModelLayout` is the simulator's whole view of a model: which transformer blocks route tokens to
experts, how many experts each holds, and the bytes of one expert's gate, up and down parts. Engines
move experts as whole (gate + up + down) blobs, and ds4 sizes its GPU cache slots per *size class*,
the pair (gate part bytes, down part bytes), so mixed-quant files get one slot pool per class.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from sim.errors import InputError
from sim.model.quant import QUANT_TYPES, quant_type, tensor_bytes
from sim.units import GIB, MIB

# Trace files store expert ids as uint16 with 0xFFFF meaning "not recorded" (sim/trace/format.py).
MAX_EXPERTS = 0xFFFF - 1


def _require_int(where: str, field: str, value: object, minimum: int, maximum: int | None = None) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise InputError(where, field, value, "must be an integer")
    if value < minimum or (maximum is not None and value > maximum):
        bound = f"{minimum}..{maximum}" if maximum is not None else f">= {minimum}"
        raise InputError(where, field, value, f"must be {bound}")


def _part_bytes(where: str, part: str, type_name: str, row_weights: int, n_rows: int) -> int:
    """Bytes of one expert's part: ggml quantizes along rows, so each row must be whole blocks."""
    qt = quant_type(type_name)
    if row_weights % qt.block_weights:
        raise InputError(where, f"{part} row", row_weights,
                         f"{qt.name} needs rows that are a multiple of {qt.block_weights} weights")
    return tensor_bytes(qt.name, row_weights * n_rows, row_weights)


@dataclass(frozen=True)
class ExpertLayer:
    """One routed-expert layer: the types and bytes of ONE expert's gate, up and down parts.

    With a fused `ffn_gate_up_exps` tensor the gate and up halves are stored back to back (gate first),
    so gate_bytes == up_bytes and both halves share one type.
    """

    block: int
    gate_type: str
    up_type: str
    down_type: str
    gate_bytes: int
    up_bytes: int
    down_bytes: int
    fused_gate_up: bool = False
    mtp: bool = False

    def __post_init__(self) -> None:
        where = f"expert layer blk.{self.block}"
        _require_int(where, "block", self.block, 0)
        for part in ("gate", "up", "down"):
            type_name = getattr(self, f"{part}_type")
            if type_name not in QUANT_TYPES:
                raise InputError(where, f"{part}_type", type_name, f"not a GGML type name ({', '.join(QUANT_TYPES)})")
            _require_int(where, f"{part}_bytes", getattr(self, f"{part}_bytes"), 1)
        if self.fused_gate_up and (self.gate_type, self.gate_bytes) != (self.up_type, self.up_bytes):
            raise InputError(where, "fused_gate_up", (self.gate_type, self.gate_bytes, self.up_type, self.up_bytes),
                             "a fused gate_up tensor has one type and equal halves")

    @property
    def expert_bytes(self) -> int:
        return self.gate_bytes + self.up_bytes + self.down_bytes

    @classmethod
    def from_types(cls, block: int, hidden: int, expert_width: int, gate_type: str, up_type: str, down_type: str,
                   *, fused_gate_up: bool = False, mtp: bool = False) -> "ExpertLayer":
        """A layer whose parts are hidden × expert_width weights each, sized from the GGML block table.

        gate and up rows run along `hidden` (ne = [hidden, expert_width]); down rows along `expert_width`.
        """
        where = f"expert layer blk.{block}"
        return cls(
            block, gate_type, up_type, down_type,
            _part_bytes(where, "gate", gate_type, hidden, expert_width),
            _part_bytes(where, "up", up_type, hidden, expert_width),
            _part_bytes(where, "down", down_type, expert_width, hidden),
            fused_gate_up, mtp,
        )


@dataclass(frozen=True, eq=False)
class SizeClasses:
    """Layers grouped by (gate_bytes, down_bytes), in the order a forward pass first touches them.

    expert_bytes is the largest expert of the class: a cache slot must hold any expert of it.
    Arrays are read-only.
    """

    class_of_layer: np.ndarray  # int16 [len(layers)]
    keys: tuple[tuple[int, int], ...]
    expert_bytes: np.ndarray  # int64 [n_classes]
    layers_per_class: np.ndarray  # int64 [n_classes]

    @property
    def n_classes(self) -> int:
        return len(self.keys)


def _spans(numbers: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> "0-2, 5, 7-8"."""
    spans: list[list[int]] = []
    for n in sorted(numbers):
        if spans and n == spans[-1][1] + 1:
            spans[-1][1] = n
        else:
            spans.append([n, n])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


@dataclass(frozen=True)
class ModelLayout:
    """The routed-expert layout of one model file (or preset). Trace layer i is layers[i].

    layers: routed-expert layers in block order; MTP (nextn) layers, if any, come last, so a trace that
    leaves MTP out simply has n_routed_layers layers.
    source: where the numbers come from (a reference section, or the GGUF file read).
    """

    name: str
    source: str
    n_blocks: int
    n_experts: int
    top_k: int
    n_shared_experts: int
    hidden: int
    expert_width: int
    dense_blocks: tuple[int, ...]
    layers: tuple[ExpertLayer, ...]

    def __post_init__(self) -> None:
        # Lists would make the layout unhashable; accept them and store tuples.
        object.__setattr__(self, "dense_blocks", tuple(self.dense_blocks))
        object.__setattr__(self, "layers", tuple(self.layers))
        where = f"model {self.name!r}"
        if not isinstance(self.name, str) or not self.name:
            raise InputError("model layout", "name", self.name, "must be a non-empty string")
        if not isinstance(self.source, str) or not self.source:
            raise InputError(where, "source", self.source, "must say where the numbers come from")
        _require_int(where, "n_blocks", self.n_blocks, 1)
        _require_int(where, "n_experts", self.n_experts, 1, MAX_EXPERTS)
        _require_int(where, "top_k", self.top_k, 1, self.n_experts)
        _require_int(where, "n_shared_experts", self.n_shared_experts, 0)
        _require_int(where, "hidden", self.hidden, 1)
        _require_int(where, "expert_width", self.expert_width, 1)
        if not self.layers:
            raise InputError(where, "layers", (), "a MoE model needs at least one routed-expert layer")
        previous_block, seen_mtp = -1, False
        for i, layer in enumerate(self.layers):
            if not isinstance(layer, ExpertLayer):
                raise InputError(where, f"layers[{i}]", type(layer).__name__, "must be an ExpertLayer")
            if layer.block <= previous_block or layer.block >= self.n_blocks:
                raise InputError(where, f"layers[{i}].block", layer.block,
                                 f"blocks must increase and be < n_blocks={self.n_blocks}")
            if seen_mtp and not layer.mtp:
                raise InputError(where, f"layers[{i}].mtp", False, "MTP layers must come after all routed layers")
            previous_block, seen_mtp = layer.block, seen_mtp or layer.mtp
        if self.n_routed_layers == 0:
            raise InputError(where, "layers", "MTP only", "needs at least one non-MTP routed layer")
        routed_blocks = {layer.block for layer in self.layers}
        previous_block = -1
        for block in self.dense_blocks:
            _require_int(where, "dense_blocks", block, previous_block + 1, self.n_blocks - 1)
            if block in routed_blocks:
                raise InputError(where, "dense_blocks", block, "a block is either dense or routed")
            previous_block = block

    @property
    def n_routed_layers(self) -> int:
        return sum(not layer.mtp for layer in self.layers)

    @property
    def n_mtp_layers(self) -> int:
        return sum(layer.mtp for layer in self.layers)

    def expert_bytes_per_layer(self) -> np.ndarray:
        """int64 [len(layers)]: bytes of one expert (gate + up + down) of each layer."""
        return np.array([layer.expert_bytes for layer in self.layers], dtype=np.int64)

    def size_classes(self) -> SizeClasses:
        """Classes keyed by (gate_bytes, down_bytes) like ds4's per-class caches (PR #504), first touch first."""
        index: dict[tuple[int, int], int] = {}
        class_of_layer = np.empty(len(self.layers), dtype=np.int16)
        for i, layer in enumerate(self.layers):
            class_of_layer[i] = index.setdefault((layer.gate_bytes, layer.down_bytes), len(index))
        expert_bytes = np.zeros(len(index), dtype=np.int64)
        np.maximum.at(expert_bytes, class_of_layer, self.expert_bytes_per_layer())
        layers_per_class = np.bincount(class_of_layer, minlength=len(index)).astype(np.int64)
        for arr in (class_of_layer, expert_bytes, layers_per_class):
            arr.setflags(write=False)
        return SizeClasses(class_of_layer, tuple(index), expert_bytes, layers_per_class)

    @property
    def max_expert_bytes(self) -> int:
        return max(layer.expert_bytes for layer in self.layers)

    @property
    def total_expert_bytes(self) -> int:
        """Bytes of every routed expert the model holds, MTP layers included."""
        return self.n_experts * sum(layer.expert_bytes for layer in self.layers)

    def describe(self) -> dict:
        """What `expertsim model show` prints: the geometry, and per size class (ds4's per-class caches) the
        expert bytes, the tensor types and the layers it spans."""
        classes = self.size_classes()
        rows = []
        for c in range(classes.n_classes):
            members = [layer for layer, k in zip(self.layers, classes.class_of_layer) if k == c]
            types = sorted({f"{m.gate_type}/{m.up_type}/{m.down_type}" for m in members})
            rows.append({"class": c, "expert_bytes": int(classes.expert_bytes[c]),
                         "expert_mib": int(classes.expert_bytes[c]) / MIB, "layers": int(classes.layers_per_class[c]),
                         "types": ", ".join(types), "blocks": _spans([m.block for m in members]),
                         "class_bytes": int(classes.expert_bytes[c]) * self.n_experts * int(classes.layers_per_class[c])})
        return {"name": self.name, "source": self.source, "blocks": self.n_blocks,
                "routed_layers": self.n_routed_layers, "mtp_layers": self.n_mtp_layers,
                "dense_blocks": _spans(list(self.dense_blocks)), "experts_per_layer": self.n_experts,
                "top_k": self.top_k, "shared_experts": self.n_shared_experts, "hidden": self.hidden,
                "expert_width": self.expert_width, "max_expert_bytes": self.max_expert_bytes,
                "total_expert_bytes": self.total_expert_bytes, "total_expert_gib": self.total_expert_bytes / GIB,
                "size_classes": rows}

    def to_dict(self) -> dict:
        """JSON-able form for provenance records; derived numbers are included for readers of the record."""
        out = dataclasses.asdict(self)
        out["dense_blocks"] = list(self.dense_blocks)
        out["layers"] = [dict(d, expert_bytes=layer.expert_bytes) for d, layer in zip(out["layers"], self.layers)]
        out["max_expert_bytes"] = self.max_expert_bytes
        out["total_expert_bytes"] = self.total_expert_bytes
        return out
