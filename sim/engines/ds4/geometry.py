"""What ds4 sees of a model file: its family, and the layers it routes with their expert sizes and size classes."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from sim.schema import check_int

FAMILIES = ("deepseek-v4.1", "deepseek-v4", "glm-5.2")  # V4.1 before V4: the longer name first


def expert_bytes(gate_bytes: int, down_bytes: int) -> int:
    """Bytes of one cached expert: gate and up slabs (gate_bytes each) plus the down slab (§1.2, §1.3)."""
    check_int("ds4 expert size", "gate_bytes", gate_bytes, 1)
    check_int("ds4 expert size", "down_bytes", down_bytes, 1)
    return 2 * gate_bytes + down_bytes


def family_of(layout, compute_key: str | None) -> str | None:
    """Which of ds4's models a file is, by its model class (the hardware profile's compute key: the preset's
    name, or model_class for a GGUF), else the layout's name: "deepseek-v4", "deepseek-v4.1" or "glm-5.2"; None
    for any other."""
    key = compute_key or layout.name
    return next((family for family in FAMILIES if key.startswith(family)), None)


def model_family(scenario) -> str | None:
    """Which of ds4's models a scenario's file is (family_of)."""
    return family_of(scenario.layout, scenario.compute_key)


@dataclass(frozen=True, eq=False)
class Layers:
    """The layers a ds4 run routes: the forward pass, then (with --mtp on a variant that runs the draft while
    streaming) the file's MTP layers, each with its expert parts' bytes and its size class ((gate, down) bytes, in
    first-touch order: ds4's per-class caches after #504)."""

    n_routed: int  # the forward pass; the MTP layers come after them
    n_experts: int
    mtp_layers: tuple[int, ...]
    part_bytes: np.ndarray  # int64 [layer, (gate, up, down)]
    expert_bytes: np.ndarray  # int64 [layer]
    class_of_layer: np.ndarray  # [layer]
    class_keys: tuple[tuple[int, int], ...]
    class_bytes: tuple[int, ...]  # one cached expert of each class

    @classmethod
    def of(cls, layout, mtp: bool) -> "Layers":
        n_routed = layout.n_routed_layers
        mtp_layers = tuple(range(n_routed, n_routed + layout.n_mtp_layers)) if mtp else ()
        layers = layout.layers[: n_routed + len(mtp_layers)]
        part_bytes = np.array([[x.gate_bytes, x.up_bytes, x.down_bytes] for x in layers], np.int64)
        classes: dict = {}
        for x in layers:
            classes.setdefault((x.gate_bytes, x.down_bytes), len(classes))
        return cls(n_routed, layout.n_experts, mtp_layers, part_bytes, part_bytes.sum(axis=1),
                   np.array([classes[(x.gate_bytes, x.down_bytes)] for x in layers]), tuple(classes),
                   tuple(expert_bytes(g, d) for g, d in classes))

    @cached_property  # asked every decode token
    def routed_layers(self) -> np.ndarray:
        """The forward pass's layers, in order (int64)."""
        return np.arange(self.n_routed, dtype=np.int64)

    @cached_property
    def all_layers(self) -> np.ndarray:
        """The forward pass's layers, then the MTP layers (int64)."""
        return np.arange(self.count, dtype=np.int64)

    @property
    def n_classes(self) -> int:
        return len(self.class_keys)

    @property
    def count(self) -> int:
        """Layers routed per token: the forward pass and the MTP layers."""
        return len(self.expert_bytes)
