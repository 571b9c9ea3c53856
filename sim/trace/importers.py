"""Import routing traces recorded by other tools into a `Trace` (docs/trace-format.md, "Importers").

Formats:
  vllm-jsonl  one JSON object per `FusedMoE.select_experts` call and token, as dumped by a patched vLLM
              (keys dataset, problem_id, layer, experts, gating_probs, and token_pos or token_idx).
  csv         request, position, phase, layer, e0..e{k-1}[, w0..w{k-1}] with a header line.
  jsonl       {"request", "position", "phase", "layer", "experts": [...], "weights": [...]} per line.

The readers (sim/trace/import_readers.py) turn the bytes into columns; the checks (sim/trace/import_checks.py)
are vectorised and name the input line of the first offending record. Every defect is an InputError.
"""

from __future__ import annotations

import codecs
import hashlib
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from sim.errors import InputError, require_regular_file
from sim.trace.format import MISSING, PHASE_DECODE, PHASE_PREFILL, Trace
from sim.trace.import_checks import (_check_duplicates, _check_layers, _check_size, _Cols, _Ctx, _expert_ids, _first,
                                     _trace, _weights)
from sim.trace.import_readers import JSONL_FIELDS, VLLM_FIELDS, _clip, _first_line, _read_csv, _read_jsonl

FORMATS = ("auto", "vllm-jsonl", "csv", "jsonl")
PHASE_WORDS = ("prefill", "decode", "0", "1")  # index % 2 is the phase code

# ---------------------------------------------------------------------------------------------- entry


def import_trace(path: str | Path, fmt: str = "auto", *, n_experts: int | None = None,
                 model: str | None = None, top_k: int | None = None) -> Trace:
    """Read a routing trace in one of FORMATS; any defect in the input raises InputError."""
    where = str(path)
    if fmt not in FORMATS:
        raise InputError(where, "format", fmt, f"unknown format; expected one of {', '.join(FORMATS)}")
    require_regular_file(path, where, "a trace file" if fmt == "auto" else f"a {fmt} trace file")
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        raise InputError(where, "path", where, "no such file") from None
    except OSError as exc:
        raise InputError(where, "path", where, f"cannot read: {exc.strerror or exc}") from None
    file_sha256 = hashlib.sha256(data).hexdigest()
    # a byte-order mark opens files that Excel and Notepad save as UTF-8; it is no part of the first column's name
    data = data.removeprefix(codecs.BOM_UTF8)
    if not data or data.isspace():
        raise InputError(where, "file", f"{len(data)} bytes", "empty file: no records")
    if top_k is not None and (not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1):
        raise InputError(where, "top_k", top_k, "must be a positive integer")
    n_experts, n_experts_note = _n_experts_from(where, n_experts, model)
    if fmt == "auto":
        fmt = _detect(where, data)
    ctx = _Ctx(where, fmt, model, n_experts, n_experts_note, top_k, file_sha256)
    if fmt == "vllm-jsonl":
        cols, lines = _read_jsonl(where, data, VLLM_FIELDS)
        trace = _build_vllm(ctx, cols, lines)
    else:
        cols, lines = _read_jsonl(where, data, JSONL_FIELDS) if fmt == "jsonl" else _read_csv(where, data)
        trace = _build_generic(ctx, cols, lines)
    if model is not None:
        _check_shape(where, trace, model)
    return trace


def _check_shape(where: str, trace: Trace, model: str) -> None:
    """A trace said to be of `model` has its layers (routed, or routed + MTP) and its top-k: a trace of another
    model would be simulated with the wrong expert sizes."""
    from sim.model.presets import get_preset

    layout = get_preset(model)
    h = trace.header
    if h.n_layers not in (layout.n_routed_layers, len(layout.layers)):
        raise InputError(where, "n_layers", h.n_layers, f"model {model} has {layout.n_routed_layers} routed "
                                                        f"layers ({len(layout.layers)} with MTP)")
    if h.top_k != layout.top_k:
        raise InputError(where, "top_k", h.top_k, f"model {model} routes each token to {layout.top_k} experts")


def _n_experts_from(where: str, n_experts, model):
    """n_experts as given, else from the model preset, else None (infer from the ids)."""
    if n_experts is not None:
        if not isinstance(n_experts, int) or isinstance(n_experts, bool) or not 1 <= n_experts < int(MISSING):
            raise InputError(where, "n_experts", n_experts, f"must be an integer in 1..{int(MISSING) - 1}")
    if model is None:
        return n_experts, None
    from sim.model.presets import get_preset  # lazy: the model package imports heavier things

    try:
        preset = get_preset(model)
    except InputError:
        raise
    except (KeyError, ValueError, LookupError) as exc:
        raise InputError(where, "model", model, f"unknown model preset ({exc})") from None
    from_preset = int(preset.n_experts)
    if n_experts is not None and n_experts != from_preset:
        raise InputError(where, "n_experts", n_experts, f"model {model} has {from_preset} experts per layer")
    return from_preset, None if n_experts is not None else f"from model preset {model}"


def _detect(where: str, data: bytes) -> str:
    """Pick a format from the file name and its first non-blank line."""
    if where.lower().endswith(".csv"):
        return "csv"
    number, first = _first_line(data, b" \t\r\n")
    first = first.strip()
    if first.startswith(b"{"):
        try:
            obj = json.loads(first.decode("utf-8"))
        except (ValueError, RecursionError) as exc:
            raise InputError(f"{where}:{number}", "json", _clip(first), f"malformed JSON: {exc}") from None
        if isinstance(obj, dict):
            if "token_pos" in obj or "token_idx" in obj or "problem_id" in obj:
                return "vllm-jsonl"
            if "request" in obj or "position" in obj:
                return "jsonl"
        raise InputError(f"{where}:{number}", "keys", sorted(obj) if isinstance(obj, dict) else type(obj).__name__,
                         "cannot tell the format from the first record; pass fmt=vllm-jsonl or jsonl")
    if b"," in first and b"layer" in first:
        return "csv"
    raise InputError(where, "format", "auto", "cannot tell the format from the first line; pass fmt=...")


# ------------------------------------------------------------------------------------------ builders


def _build_vllm(ctx: _Ctx, cols: dict, lines: np.ndarray) -> Trace:
    c = _Cols(ctx.where, cols, lines)
    has_pos, has_idx = c.present("token_pos"), c.present("token_idx")
    raw = bool(has_pos[0])
    if not raw and not has_idx[0]:
        c.fail(0, "token_pos", "missing key: a record needs token_pos (raw file) or token_idx (decode-only)",
               value="absent")
    row = _first(has_idx if raw else has_pos)
    if row is not None:
        c.fail(row, "token_idx" if raw else "token_pos",
               f"mixes token_pos and token_idx records (line {int(lines[0])} set the kind)")
    pos_field = "token_pos" if raw else "token_idx"
    pos = c.ints(pos_field)
    layer = c.ints("layer")
    dataset, problem = c.keys("dataset"), c.keys("problem_id")
    ids, k, n_experts, notes = _expert_ids(ctx, c)
    weights = _weights(c, "gating_probs", k)
    joined = pc.binary_join_element_wise(dataset, problem, "\x1f")
    req = pc.dictionary_encode(joined).indices.to_numpy(zero_copy_only=False).astype(np.int64)
    first = np.unique(req, return_index=True)[1]  # codes follow first appearance
    names = [f"{dataset[int(i)].as_py()}/{problem[int(i)].as_py()}" for i in first]
    n_req = len(names)
    n_layers = int(layer.max()) + 1
    _check_layers(c, layer, n_layers)
    if raw:
        step, prefill_len, decode_len = _raw_steps(c, req, layer, pos, n_req, n_layers)
        first_pos = np.zeros(n_req, dtype=np.int64)
        lengths = prefill_len + decode_len
        variant = "prefill+decode"
    else:  # one row per token_idx from the request's smallest to its largest
        step = pos
        first_pos = np.full(n_req, np.iinfo(np.int64).max, dtype=np.int64)
        last = np.zeros(n_req, dtype=np.int64)
        np.minimum.at(first_pos, req, pos)
        np.maximum.at(last, req, pos)
        prefill_len = np.zeros(n_req, dtype=np.int64)
        lengths = last - first_pos + 1
        variant = "decode-only"
    _check_size(c, int(lengths.sum()), n_layers, layer, pos_field, step - first_pos[req])
    offsets = np.concatenate(([0], np.cumsum(lengths)))
    row_of = offsets[req] + step - first_pos[req]
    request = np.repeat(np.arange(n_req, dtype=np.int64), lengths)
    position = np.arange(int(offsets[-1]), dtype=np.int64) - offsets[request] + first_pos[request]
    phase = np.where(position - first_pos[request] >= prefill_len[request], PHASE_DECODE, PHASE_PREFILL)
    _check_duplicates(c, row_of * n_layers + layer, pos_field)
    return _trace(ctx, variant, n_layers, k, n_experts, notes, request, position, phase,
                  row_of, layer, ids, weights, {"requests": names})


def _raw_steps(c: _Cols, req, layer, pos, n_req, n_layers):
    """Split a prefill+decode file. Per (request, layer), in file order, decode starts at the first record
    with token_pos 0 that is not the group's first record (the reset); every decode record has token_pos 0
    and the d-th one is decode step d. Returns each record's step (its row within the request: token_pos
    for prefill, prefill length + d for decode) and, per request, the prefill length P (max prefill
    token_pos + 1 over layers) and the number of decode steps (max d + 1 over layers)."""
    group = req * n_layers + layer
    order = np.argsort(group, kind="stable")
    g_sorted, p_sorted = group[order], pos[order]
    start = np.ones(len(order), dtype=bool)
    start[1:] = g_sorted[1:] != g_sorted[:-1]
    group_id = np.cumsum(start) - 1
    start_at = np.flatnonzero(start)

    def in_group_cumsum(flags):
        flags = flags.astype(np.int64)
        total = np.cumsum(flags)
        before = total[start_at] - flags[start_at]
        return total - before[group_id]

    decode_sorted = in_group_cumsum((p_sorted == 0) & ~start) > 0
    decode = np.empty_like(decode_sorted)
    decode[order] = decode_sorted
    row = _first(decode & (pos != 0))
    if row is not None:
        c.fail(row, "token_pos", "a decode record (after the reset to 0) must have token_pos 0")
    d = np.empty(len(order), dtype=np.int64)
    d[order] = in_group_cumsum(decode_sorted) - 1
    prefill_len = np.zeros(n_req, dtype=np.int64)
    np.maximum.at(prefill_len, req[~decode], pos[~decode] + 1)
    decode_len = np.zeros(n_req, dtype=np.int64)
    np.maximum.at(decode_len, req[decode], d[decode] + 1)
    step = np.where(decode, prefill_len[req] + d, pos)
    return step, prefill_len, decode_len


def _build_generic(ctx: _Ctx, cols: dict, lines: np.ndarray) -> Trace:
    """Rows are the distinct (request, position, phase) in order of first appearance in the file."""
    c = _Cols(ctx.where, cols, lines)
    request = c.ints("request")
    position = c.ints("position")
    phase_index = pc.index_in(pc.utf8_trim_whitespace(c.keys("phase")), value_set=pa.array(PHASE_WORDS))
    row = _first(phase_index.is_null().to_numpy(zero_copy_only=False))
    if row is not None:
        c.fail(row, "phase", "unknown phase: expected prefill, decode, 0 or 1")
    phase = phase_index.to_numpy(zero_copy_only=False).astype(np.int64) % 2
    layer = c.ints("layer")
    ids, k, n_experts, notes = _expert_ids(ctx, c)
    weights = _weights(c, "weights", k)
    n_layers = int(layer.max()) + 1
    _check_layers(c, layer, n_layers)
    key = (request << 32) | (position << 1) | phase
    uniques, first, inverse = np.unique(key, return_index=True, return_inverse=True)
    rank = np.empty(len(uniques), dtype=np.int64)
    rank[np.argsort(first, kind="stable")] = np.arange(len(uniques))
    row_of, first = rank[inverse.reshape(-1)], np.sort(first)
    _check_size(c, len(first), n_layers, layer, "layer", layer)
    _check_duplicates(c, row_of * n_layers + layer, "layer")
    return _trace(ctx, "rows in order of first appearance", n_layers, k, n_experts, notes,
                  request[first], position[first], phase[first], row_of, layer, ids, weights, {})
