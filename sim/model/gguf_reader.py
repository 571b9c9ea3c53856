"""Read a MoE model's expert layout from a GGUF file header, never touching the weights.

Expert tensor forms accepted (reference/hardware-and-gguf.md §3.3):
- `blk.N.ffn_{gate,up,down}_exps.weight`, 3D with ne = [ne0, ne1, n_expert]: expert e's part is the
  contiguous slice [start + e*S, start + (e+1)*S) with S = tensor bytes / n_expert (§0 rule 5);
- `blk.N.ffn_gate_up_exps.weight`, gate and up fused, gate rows first (llama.cpp PR #19139);
- `blk.N.ffn_{gate,up,down}.E.weight`, one 2D tensor per expert (Mixtral/Grok files before llama.cpp
  PR #6387).
The last `{arch}.nextn_predict_layers` blocks are MTP layers; blocks with a plain `ffn_gate.weight` and no
experts are dense. Tensor bytes come from sim.model.quant, not from gguf, so types gguf does not know yet
(Q2_0) still size, and an unknown type id is refused by name.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
from gguf import GGUFReader, GGUFValueType

from sim.errors import InputError, require_regular_file
from sim.model.layout import MAX_EXPERTS, ExpertLayer, ModelLayout
from sim.model.quant import QuantType, quant_type, tensor_bytes

PARTS = ("gate", "up", "down")
_N = r"(0|[1-9][0-9]*)"  # block and expert numbers, without leading zeros that would alias
_EXPS = re.compile(rf"blk\.{_N}\.ffn_(gate_up|gate|up|down)_exps\.weight")
_LEGACY = re.compile(rf"blk\.{_N}\.ffn_(gate|up|down)\.{_N}\.weight")
_DENSE = re.compile(rf"blk\.{_N}\.ffn_(?:gate|up|down)\.weight")
_SHARED = re.compile(rf"blk\.{_N}\.ffn_(?:gate|up|down)_shexp\.weight")
_BLOCK = re.compile(rf"blk\.{_N}\.")
_INT_TYPES = {GGUFValueType.UINT8, GGUFValueType.INT8, GGUFValueType.UINT16, GGUFValueType.INT16,
              GGUFValueType.UINT32, GGUFValueType.INT32, GGUFValueType.UINT64, GGUFValueType.INT64}


@dataclass(frozen=True, eq=False)
class GgufModel:
    """A GGUF file's expert layout plus where every expert part starts in the file.

    offsets: int64 [len(layout.layers), 3, n_experts], absolute file offsets of the (gate, up, down)
    part of each expert; part p of expert e in layer i is the byte range
    [offsets[i, p, e], offsets[i, p, e] + layer.{p}_bytes). With a fused gate_up tensor the up part
    starts right after the gate part, so one read of gate_bytes + up_bytes fetches both.
    """

    path: str
    layout: ModelLayout
    offsets: np.ndarray
    file_bytes: int


class _RawTensor(NamedTuple):
    name: str
    ne: tuple[int, ...]  # GGML order: ne[0] is the contiguous row length
    type_id: int
    start: int  # absolute file offset of the first data byte


class _ReadPastEnd(Exception):
    """A header field claims bytes the file does not have."""


class _HeaderReader(GGUFReader):
    """gguf's header parser with guards against corrupt lengths, and raw tensor infos.

    gguf's `_get` returns a short array past the end of the file, and its array parser loops once per
    claimed item, so one corrupt array length means up to 2**64 rounds. Here `_get` refuses to read past
    the end, and an array whose items cannot fit in the rest of the file is refused before the loop.
    `_build_tensors` keeps the raw tensor infos instead of mapping every tensor's data and looking its
    type up in gguf's enum.
    """

    def _past_end(self, offset: int, n_bytes: int) -> None:
        if offset + n_bytes > self.data.shape[0]:
            raise _ReadPastEnd(f"a header field at byte {offset} claims {n_bytes} bytes, past the end of the "
                               f"file ({self.data.shape[0]} bytes)")

    def _get(self, offset, dtype, count=1, override_order=None):
        self._past_end(int(offset), np.dtype(dtype).itemsize * int(count))
        return super()._get(offset, dtype, count, override_order)

    def _get_field_parts(self, orig_offs, raw_type):
        if raw_type == GGUFValueType.ARRAY:
            item_type = int(self._get(orig_offs, np.uint32)[0])
            count = int(self._get(orig_offs + 4, np.uint64)[0])
            scalar = self.gguf_scalar_to_np.get(item_type)
            # The smallest an item can be: a scalar's size; a string's u64 length; an array's type + length.
            item_bytes = np.dtype(scalar).itemsize if scalar else 8 if item_type == GGUFValueType.STRING else 12
            self._past_end(orig_offs + 12, count * item_bytes)
        return super()._get_field_parts(orig_offs, raw_type)

    def _build_tensors(self, start_offs, fields) -> None:
        self.raw_tensors: list[_RawTensor] = []
        names = set()
        for field in fields:
            _name_len, name_data, _n_dims, dims, raw_type, offset = field.parts
            name = bytes(name_data).decode("utf-8")
            if name in names:
                raise ValueError(f"duplicated tensor name {name}")
            names.add(name)
            ne = tuple(int(d) for d in dims)
            self.raw_tensors.append(_RawTensor(name, ne, int(raw_type[0]), int(start_offs) + int(offset[0])))


def _one_line(text: object, limit: int = 160) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _open(where: str) -> _HeaderReader:
    require_regular_file(where, where, "a GGUF file")
    try:
        return _HeaderReader(where)
    except FileNotFoundError:
        raise InputError(where, "path", where, "no such file") from None
    except OSError as exc:
        raise InputError(where, "path", where, f"cannot read: {_one_line(exc.strerror or exc)}") from None
    except _ReadPastEnd as exc:
        raise InputError(where, "GGUF header", "truncated", _one_line(exc)) from None
    # What gguf raises on a malformed header: bad magic/version/value type/alignment (ValueError, incl.
    # UnicodeDecodeError), duplicate keys (KeyError); nested arrays deep enough exhaust the stack.
    except (ValueError, KeyError, IndexError, OverflowError, RecursionError) as exc:
        raise InputError(where, "GGUF header", _one_line(exc), "not a readable GGUF file") from None


def _kv_int(reader: _HeaderReader, where: str, key: str) -> int | None:
    field = reader.fields.get(key)
    if field is None:
        return None
    if len(field.types) != 1 or field.types[0] not in _INT_TYPES:
        raise InputError(where, key, "/".join(t.name for t in field.types), "expected one integer value")
    return int(field.contents())


def _kv_str(reader: _HeaderReader, where: str, key: str) -> str | None:
    field = reader.fields.get(key)
    if field is None:
        return None
    if field.types != [GGUFValueType.STRING]:
        raise InputError(where, key, "/".join(t.name for t in field.types), "expected a string value")
    try:
        return field.contents()
    except UnicodeDecodeError:
        raise InputError(where, key, bytes(field.parts[-1][:40]), "not UTF-8") from None


class _Part(NamedTuple):
    qt: QuantType
    expert_bytes: int
    starts: list[int]  # file offset of each expert's slice, expert order


def _read_part(where: str, tensors: list[_RawTensor], three_d: bool, file_bytes: int) -> _Part:
    """One part (gate, up, down or gate_up) of one layer: a single 3D tensor or one 2D tensor per expert."""
    parts = []
    for t in tensors:
        want_dims = 3 if three_d else 2
        if len(t.ne) != want_dims or min(t.ne) < 1:
            raise InputError(where, t.name, list(t.ne), f"expected {want_dims} dimensions, each >= 1")
        try:
            qt = quant_type(t.type_id)
        except InputError as exc:
            raise InputError(where, f"{t.name} type", t.type_id, exc.why) from None
        if t.ne[0] % qt.block_weights:
            raise InputError(where, f"{t.name} ne0", t.ne[0],
                             f"{qt.name} rows must be whole {qt.block_weights}-weight blocks")
        expert_bytes = tensor_bytes(qt.name, t.ne[0] * t.ne[1], t.ne[0])
        n = t.ne[2] if three_d else 1
        if n > MAX_EXPERTS:
            raise InputError(where, f"{t.name} n_expert", n, f"more than {MAX_EXPERTS} experts")
        end = t.start + n * expert_bytes
        if end > file_bytes:
            raise InputError(where, t.name, f"data ends at byte {end}", f"file is truncated ({file_bytes} bytes)")
        parts.append(_Part(qt, expert_bytes, [t.start + e * expert_bytes for e in range(n)]))
    first = parts[0]
    for t, p in zip(tensors[1:], parts[1:]):
        if (p.qt, p.expert_bytes, t.ne) != (first.qt, first.expert_bytes, tensors[0].ne):
            raise InputError(where, t.name, f"{p.qt.name} {list(t.ne)}",
                             f"experts of one layer differ: {tensors[0].name} is {first.qt.name} {list(tensors[0].ne)}")
    return _Part(first.qt, first.expert_bytes, [s for p in parts for s in p.starts])


def _layer_tensors(where: str, block: int, exps: dict, legacy: dict) -> tuple[bool, bool, dict[str, list[_RawTensor]]]:
    """(three_d, fused, part name -> tensors in expert order) for one block, refusing incomplete layers."""
    if block in exps and block in legacy:
        raise InputError(where, f"blk.{block}", "ffn_*_exps and ffn_*.E tensors", "a layer uses one expert form")
    if block in exps:
        found = exps[block]
        fused = "gate_up" in found
        if fused and ("gate" in found or "up" in found):
            raise InputError(where, f"blk.{block}.ffn_gate_up_exps.weight", "with separate gate/up",
                             "a layer has either a fused gate_up tensor or separate gate and up tensors")
        for part in ("gate_up", "down") if fused else PARTS:
            if part not in found:
                raise InputError(where, f"blk.{block}.ffn_{part}_exps.weight", "absent",
                                 f"layer has {', '.join(sorted(found))} but not {part}")
        return True, fused, {part: [t] for part, t in found.items()}
    found = legacy[block]
    out = {}
    for part in PARTS:
        if part not in found:
            raise InputError(where, f"blk.{block}.ffn_{part}.E.weight", "absent",
                             f"layer has per-expert {', '.join(sorted(found))} but not {part}")
        ids = sorted(found[part])
        if ids != list(range(len(ids))):
            raise InputError(where, f"blk.{block}.ffn_{part}.E.weight", f"experts {ids[:8]}",
                             "per-expert tensors must be numbered 0..n_expert-1 without gaps")
        out[part] = [found[part][e] for e in ids]
    return False, False, out


def layout_from_gguf(path: str | Path) -> ModelLayout:
    """The layout of a GGUF file, read from its header (read_gguf also gives every expert part's offset)."""
    return read_gguf(path).layout


def read_gguf(path: str | Path) -> GgufModel:
    """The expert layout and per-expert file offsets of a GGUF model; InputError on any defect."""
    where = str(path)
    reader = _open(where)
    file_bytes = int(reader.data.shape[0])
    arch = _kv_str(reader, where, "general.architecture")
    if not arch:
        raise InputError(where, "general.architecture", "absent", "a GGUF model names its architecture")
    split_count = _kv_int(reader, where, "split.count")
    if split_count is not None and split_count > 1:
        raise InputError(where, "split.count", split_count,
                         "one shard of a split GGUF; merge the shards (llama-gguf-split --merge) and read that")

    exps: dict[int, dict[str, _RawTensor]] = {}
    legacy: dict[int, dict[str, dict[int, _RawTensor]]] = {}
    dense: set[int] = set()
    has_shared = has_latent = False
    max_block = -1
    for t in reader.raw_tensors:
        if m := _BLOCK.match(t.name):
            max_block = max(max_block, int(m[1]))
        if m := _EXPS.fullmatch(t.name):
            exps.setdefault(int(m[1]), {})[m[2]] = t
        elif m := _LEGACY.fullmatch(t.name):
            legacy.setdefault(int(m[1]), {}).setdefault(m[2], {})[int(m[3])] = t
        elif m := _DENSE.fullmatch(t.name):
            dense.add(int(m[1]))
        elif _SHARED.fullmatch(t.name):
            has_shared = True
        has_latent = has_latent or ".ffn_latent_" in t.name
    blocks = sorted(exps.keys() | legacy.keys())
    if not blocks:
        raise InputError(where, "tensors", f"{len(reader.raw_tensors)} tensors",
                         "no routed-expert tensors (blk.N.ffn_{gate,up,down}_exps.weight or blk.N.ffn_*.E.weight)")

    # Geometry is taken from the first layer's tensors and every other tensor must agree with it:
    # gate/up ne = [hidden, width], fused gate_up [hidden, 2*width], down [width, hidden].
    hidden = width = n_experts = None
    layer_parts: list[tuple[int, bool, dict[str, _Part]]] = []
    for block in blocks:
        three_d, fused, tensors = _layer_tensors(where, block, exps, legacy)
        parts = {name: _read_part(where, ts, three_d, file_bytes) for name, ts in tensors.items()}
        first_in = tensors["gate_up" if fused else "gate"][0]
        if hidden is None:
            hidden, rows = first_in.ne[0], first_in.ne[1]
            if fused and rows % 2:
                raise InputError(where, f"{first_in.name} ne1", rows, "fused gate_up needs an even row count")
            width = rows // 2 if fused else rows
        for name, ts in tensors.items():
            want = {"gate": (hidden, width), "up": (hidden, width), "gate_up": (hidden, 2 * width),
                    "down": (width, hidden)}[name]
            n = ts[0].ne[2] if three_d else len(ts)
            if n_experts is None:
                n_experts = n
            if n != n_experts:
                raise InputError(where, f"{ts[0].name} n_expert", n,
                                 f"inconsistent expert counts: blk.{blocks[0]} has {n_experts}")
            if ts[0].ne[:2] != want:
                raise InputError(where, f"{ts[0].name} ne", list(ts[0].ne[:2]),
                                 f"expected {list(want)} from blk.{blocks[0]} (hidden {hidden}, expert width {width})")
        layer_parts.append((block, fused, parts))

    kv = {key: _kv_int(reader, where, f"{arch}.{key}") for key in (
        "expert_count", "expert_used_count", "expert_shared_count", "embedding_length",
        "expert_feed_forward_length", "block_count", "nextn_predict_layers")}
    checks = [("expert_count", n_experts, "inconsistent expert counts: the expert tensors hold"),
              ("expert_feed_forward_length", width, "the expert tensors have width")]
    if not has_latent:  # a latent MoE (ffn_latent_down/up) feeds its experts a narrower vector than n_embd
        checks.append(("embedding_length", hidden, "the expert tensors have rows of"))
    for key, found, why in checks:
        if kv[key] is not None and kv[key] != found:
            raise InputError(where, f"{arch}.{key}", kv[key], f"{why} {found}")
    if kv["expert_used_count"] is None:
        raise InputError(where, f"{arch}.expert_used_count", "absent", "top-k cannot be read from the tensors")
    n_blocks = kv["block_count"] if kv["block_count"] is not None else max_block + 1
    if n_blocks <= max_block:
        raise InputError(where, f"{arch}.block_count", n_blocks, f"tensors go up to blk.{max_block}")
    n_mtp_blocks = kv["nextn_predict_layers"] or 0
    if not 0 <= n_mtp_blocks < n_blocks:
        raise InputError(where, f"{arch}.nextn_predict_layers", n_mtp_blocks, f"must be 0..{n_blocks - 1}")
    first_mtp_block = n_blocks - n_mtp_blocks

    layers, starts = [], []
    for block, fused, parts in layer_parts:
        if fused:
            gate_up = parts["gate_up"]
            half = gate_up.expert_bytes // 2  # ne1 is even, so the byte count splits exactly
            parts = {"gate": _Part(gate_up.qt, half, gate_up.starts),
                     "up": _Part(gate_up.qt, half, [s + half for s in gate_up.starts]), "down": parts["down"]}
        layers.append(ExpertLayer(
            block, *(parts[p].qt.name for p in PARTS), *(parts[p].expert_bytes for p in PARTS),
            fused_gate_up=fused, mtp=block >= first_mtp_block))
        starts.append([parts[p].starts for p in PARTS])
    shared = kv["expert_shared_count"] if kv["expert_shared_count"] is not None else int(has_shared)
    try:
        layout = ModelLayout(
            name=_kv_str(reader, where, "general.name") or Path(where).stem,
            source=f"GGUF header of {where}",
            n_blocks=n_blocks, n_experts=n_experts, top_k=kv["expert_used_count"], n_shared_experts=shared,
            hidden=hidden, expert_width=width,
            dense_blocks=tuple(sorted(dense - set(blocks))), layers=tuple(layers))
    except InputError as exc:  # name the file, not the layout, as the place to fix
        raise InputError(where, exc.field, exc.value, exc.why) from None
    return GgufModel(where, layout, np.array(starts, dtype=np.int64), file_bytes)
