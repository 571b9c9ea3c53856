"""Record a routing trace by running a local Hugging Face transformers MoE model on the CPU.

`record_trace` loads the model from a directory (never the network), runs one prefill forward over the
prompt and then greedy decoding with the KV cache, one token per forward, and writes down which experts
every token was sent to in every MoE layer, with the gate weights the model used.

How the routing is observed
---------------------------
transformers (5.x) declares, per model class, which submodule produces the router logits
(`_can_record_outputs["router_logits"]`); that is the module `output_router_logits=True` hooks. We attach
our own forward hook to the same modules, but keep the router's *whole* output: in 5.x the router returns
`(router_logits, top_k_weights, top_k_index)`, i.e. the exact expert ids and gate weights the MoE block
dispatches with (DeepSeek-style group-limited routing with score-correction bias, Gemma-4 per-expert
scales, Ernie statics etc. included). When a router returns logits only (DBRX, JetMoE, Llama-4), ids and
weights are derived from the logits: softmax over all experts, top-k, renormalised unless the config has
`norm_topk_prob = False` (right for DBRX and JetMoE; for Llama-4, which gates with a sigmoid, the ids
are right but the weights are only an approximation). With an older transformers that has no `_can_record_outputs`, the model's own
`output_router_logits=True` output is used the same way (see `generator["routing_source"]`).

Layers
------
Only MoE layers are recorded: one trace layer per router module, in decoder-layer order. Dense layers
(DeepSeek/GLM `first_k_dense_replace`, Qwen2/3-MoE `mlp_only_layers`/`decoder_sparse_step`, the
attention-only or Mamba layers of hybrids ...) have no router and are skipped; the decoder-layer index of
every recorded layer is kept in `generator["moe_layers"]` and the router module paths in
`generator["router_modules"]`. JetMoE routes its attention experts too, so it records two trace layers
per decoder layer (the attention router, then the MLP router).

Each cell's k experts are stored strongest first (descending gate weight). Gate weights are the ones the
MoE block multiplies expert outputs by, so they sum to 1 only where the model renormalises its top-k
(Mixtral, OLMoE, Qwen3-MoE ...); Qwen2-MoE with `norm_topk_prob = False` gives raw softmax probabilities
and DeepSeek-V3-style routers include `routed_scaling_factor`.

Determinism: the prompt is either tokenised text (tokenizer defaults, special tokens added, no chat
template) or random ids drawn with `numpy.random.default_rng([seed, request])`; decoding is greedy (argmax,
ties to the lowest id) and never stops early at an end-of-sequence token, so the same model, options and
seed give an identical trace on the same machine and library versions. A text prompt with requests > 1
records the same request several times.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import re
from pathlib import Path

import numpy as np

from sim.errors import InputError
from sim.trace.format import MISSING, PHASE_DECODE, PHASE_PREFILL, Trace, TraceHeader

WHERE = "trace record"
INSTALL_HINT = "recording needs torch and transformers: pip install 'expertsim[record]'"

# Config attributes that hold the number of routed experts / experts per token, most common first.
_N_EXPERTS_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts", "num_routed_experts")
_TOP_K_KEYS = ("num_experts_per_tok", "moe_top_k", "top_k_experts", "num_selected_experts", "moe_k", "top_k")
_WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.pt", "*.pth")


# --------------------------------------------------------------------------------------------- helpers


def _import_backends():
    try:
        import torch
        import transformers
    except ImportError as exc:
        raise InputError(WHERE, "dependency", getattr(exc, "name", None) or str(exc), INSTALL_HINT) from None
    return torch, transformers


def _config_value(config, keys):
    """First positive int among `keys` on the config or a nested text/ffn config; None if none."""
    seen = set()
    stack = [config]
    while stack:
        cfg = stack.pop(0)
        if cfg is None or id(cfg) in seen:
            continue
        seen.add(id(cfg))
        for key in keys:
            value = cfg.get(key) if isinstance(cfg, dict) else getattr(cfg, key, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
        for nested in ("text_config", "ffn_config", "language_config", "llm_config"):
            stack.append(cfg.get(nested) if isinstance(cfg, dict) else getattr(cfg, nested, None))
    return None


def _config_flag(config, key, default):
    for cfg in (config, getattr(config, "text_config", None), getattr(config, "ffn_config", None)):
        if cfg is None:
            continue
        value = cfg.get(key) if isinstance(cfg, dict) else getattr(cfg, key, None)
        if value is not None:
            return bool(value)
    return default


def model_sha256(model_dir: Path) -> str:
    """sha256 over config.json and the weight files' bytes, files taken in sorted name order."""
    files = {model_dir / "config.json"}
    for pattern in _WEIGHT_PATTERNS:
        files.update(p for p in model_dir.glob(pattern) if p.is_file())
    digest = hashlib.sha256()
    for path in sorted(files, key=lambda p: p.name):
        with open(path, "rb") as fh:
            while chunk := fh.read(1 << 22):
                digest.update(chunk)
    return digest.hexdigest()


def _model_name(model_dir: Path, config) -> str:
    """A hub-style name from config.json if it has one, else the directory name, else the model_type."""
    try:
        raw = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        raw = {}
    name = raw.get("_name_or_path") or ""
    if name and not Path(name).is_absolute() and not name.startswith("."):
        return name
    return model_dir.resolve().name or getattr(config, "model_type", "") or "unknown"


def _layer_index(module_name: str) -> int | None:
    """The decoder-layer index in a module path such as 'model.layers.12.mlp.gate'."""
    match = re.search(r"\.(?:layers|layer|h|blocks|block)\.(\d+)(?:\.|$)", "." + module_name)
    if match is None:
        match = re.search(r"\.(\d+)(?:\.|$)", "." + module_name)
    return int(match.group(1)) if match else None


# --------------------------------------------------------------------------------------- router hooks


def _router_specs(model):
    """(target_class, class_name, layer_name, index) for every router_logits recorder the model declares."""
    from torch import nn

    specs = []
    for module in model.modules():
        table = getattr(type(module), "_can_record_outputs", None)
        if not isinstance(table, dict) or "router_logits" not in table:
            continue
        entries = table["router_logits"]
        for spec in entries if isinstance(entries, (list, tuple)) else [entries]:
            if isinstance(spec, str):
                specs.append((None, spec, None, 0))
            elif isinstance(spec, type) and issubclass(spec, nn.Module):
                specs.append((spec, None, None, 0))
            else:
                specs.append((getattr(spec, "target_class", None), getattr(spec, "class_name", None),
                              getattr(spec, "layer_name", None), int(getattr(spec, "index", 0) or 0)))
    return specs


def _find_routers(model):
    """[(module_name, module, logits_index)] of the router modules, in decoder-layer order."""
    specs = _router_specs(model)
    found = {}
    order = 0
    for name, module in model.named_modules():
        for target, class_name, layer_name, index in specs:
            hit = (target is not None and isinstance(module, target)) or (
                class_name is not None and name.endswith(class_name))
            if hit and layer_name and ("." + layer_name.strip(".") + ".") not in ("." + name + "."):
                hit = False
            if hit and name not in found:
                found[name] = (order, module, index)
                order += 1
    routers = [(name, mod, idx, pos) for name, (pos, mod, idx) in found.items()]
    # Nested matches (a router class inside another matched module) would double count: keep outermost.
    names = [r[0] for r in routers]
    routers = [r for r in routers if not any(r[0].startswith(o + ".") for o in names if o != r[0])]
    routers.sort(key=lambda r: ((_layer_index(r[0]) if _layer_index(r[0]) is not None else 1 << 30), r[3]))
    return [(name, mod, idx) for name, mod, idx, _ in routers]


class _Routing:
    """Turns what a router returned into (ids, weights) arrays of shape [tokens, top_k]."""

    def __init__(self, torch, top_k: int | None, n_experts: int | None, normalise: bool):
        self.torch = torch
        self.top_k = top_k
        self.n_experts = n_experts
        self.normalise = normalise
        self.from_logits = False

    def from_output(self, output, logits_index: int):
        torch = self.torch
        tensors = list(output) if isinstance(output, (tuple, list)) else [output]
        logits = tensors[logits_index] if logits_index < len(tensors) else tensors[0]
        if not torch.is_tensor(logits):
            logits = next((t for t in tensors if torch.is_tensor(t) and t.is_floating_point()), None)
        ids = weights = None
        if logits is not None and logits.dim() >= 2:
            n_tokens = logits.reshape(-1, logits.shape[-1]).shape[0]
            # [tokens, k] tensors next to the [tokens, n_experts] logits: the chosen ids and their weights.
            k_shapes = [t for t in tensors if torch.is_tensor(t) and t.dim() >= 2 and t.numel()
                        and t.reshape(-1, t.shape[-1]).shape[0] == n_tokens
                        and t.shape[-1] < logits.shape[-1]]
            int_cands = [t for t in k_shapes if not t.is_floating_point()]
            if len(int_cands) == 1:
                ids = int_cands[0].reshape(n_tokens, -1)
                float_cands = [t for t in k_shapes if t.is_floating_point()
                               and t.reshape(n_tokens, -1).shape == ids.shape]
                if len(float_cands) == 1:
                    weights = float_cands[0].reshape(n_tokens, -1)
        if ids is None:
            return self.from_logits_tensor(logits)
        if weights is None:
            weights = self._weights_for(logits, ids)
        return ids.long(), weights.float()

    def _weights_for(self, logits, ids):
        probs = self.torch.softmax(logits.reshape(ids.shape[0], -1).float(), dim=-1)
        chosen = probs.gather(-1, ids.long())
        if self.normalise:
            chosen = chosen / chosen.sum(dim=-1, keepdim=True)
        return chosen

    def _topk(self, logits):
        if self.top_k is None:
            raise InputError(WHERE, "top_k", None, "the router gives logits only and the config names no "
                             "num_experts_per_tok")
        flat = logits.reshape(-1, logits.shape[-1]).float()
        probs = self.torch.softmax(flat, dim=-1)
        values, ids = self.torch.topk(probs, self.top_k, dim=-1)
        if self.normalise:
            values = values / values.sum(dim=-1, keepdim=True)
        return ids, values

    def from_logits_tensor(self, logits):
        if logits is None or not self.torch.is_tensor(logits) or logits.dim() < 2:
            raise InputError(WHERE, "router output", type(logits).__name__, "no router logits to read the routing from")
        self.from_logits = True
        return self._topk(logits)


def _strongest_first(ids, weights):
    """numpy (ids, weights) with each token's k experts ordered by descending gate weight."""
    ids = ids.detach().cpu().numpy().astype(np.int64)
    weights = weights.detach().float().cpu().numpy().astype(np.float32)
    order = np.argsort(-weights, axis=-1, kind="stable")
    return np.take_along_axis(ids, order, -1), np.take_along_axis(weights, order, -1)


# ------------------------------------------------------------------------------------------ recording


def _prompt_ids(prompt, prompt_tokens, vocab: int, seed: int, request: int, tokenizer) -> list[int]:
    if prompt is not None:
        ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
        if not ids:
            raise InputError(WHERE, "prompt", prompt, "tokenises to no tokens")
        return [int(t) for t in ids]
    rng = np.random.default_rng([seed, request])
    return rng.integers(0, vocab, size=prompt_tokens).tolist()


def record_trace(model_path: str | Path, *, prompt: str | None = None, prompt_tokens: int | None = None,
                 decode_tokens: int = 16, seed: int = 0, requests: int = 1) -> Trace:
    """Run a local HF MoE causal LM (CPU) and return its routing trace.

    One prefill forward over the prompt (rows at positions 0..P-1), then `decode_tokens` greedy decode
    steps with the KV cache (positions P..P+D-1), for each of `requests` independent requests. Exactly one
    of `prompt` (text; needs a tokenizer in model_path) and `prompt_tokens` (that many random token ids,
    seeded per request) must be given.
    """
    # -- arguments, before anything slow
    if (prompt is None) == (prompt_tokens is None):
        raise InputError(WHERE, "prompt", "both" if prompt is not None else "neither",
                         "give exactly one of a prompt text or a number of random prompt tokens")
    if prompt_tokens is not None and (isinstance(prompt_tokens, bool) or int(prompt_tokens) < 1):
        raise InputError(WHERE, "prompt_tokens", prompt_tokens, "must be at least 1")
    if prompt is not None and not isinstance(prompt, str):
        raise InputError(WHERE, "prompt", prompt, "must be text")
    if int(decode_tokens) < 0:
        raise InputError(WHERE, "decode_tokens", decode_tokens, "must be 0 or more")
    if int(requests) < 1:
        raise InputError(WHERE, "requests", requests, "must be at least 1")
    if int(seed) < 0:
        raise InputError(WHERE, "seed", seed, "must be 0 or more")
    decode_tokens, requests, seed = int(decode_tokens), int(requests), int(seed)
    model_dir = Path(model_path)
    if not model_dir.exists():
        raise InputError(str(model_path), "model", str(model_path), "no such directory")
    if not model_dir.is_dir() or not (model_dir / "config.json").is_file():
        raise InputError(str(model_path), "model", str(model_path),
                         "not a Hugging Face model directory (no config.json)")

    torch, transformers = _import_backends()
    from transformers import AutoConfig, AutoModelForCausalLM

    where = str(model_path)
    try:
        config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    except (ValueError, KeyError, OSError) as exc:
        raise InputError(where, "config.json", model_dir.name, f"transformers cannot read it: {exc}") from None

    tokenizer = None
    if prompt is not None:
        try:
            from transformers import AutoTokenizer
            tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        except (ValueError, OSError, TypeError, ImportError) as exc:
            raise InputError(where, "tokenizer", model_dir.name,
                             f"a text prompt needs a tokenizer in the model directory (or use random prompt "
                             f"tokens): {exc}") from None

    torch.manual_seed(seed)
    try:
        model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype="auto")
    except (ValueError, KeyError, OSError) as exc:
        raise InputError(where, "model", getattr(config, "model_type", "?"),
                         f"cannot load as a causal LM: {exc}") from None
    model = model.to("cpu").eval()

    vocab = _config_value(model.config, ("vocab_size",)) or int(model.get_output_embeddings().weight.shape[0])
    n_experts_cfg = _config_value(model.config, _N_EXPERTS_KEYS)
    top_k_cfg = _config_value(model.config, _TOP_K_KEYS)
    routing = _Routing(torch, top_k_cfg, n_experts_cfg, _config_flag(model.config, "norm_topk_prob", True))

    routers = _find_routers(model)
    params = inspect.signature(model.forward).parameters
    cache_kw = "cache" if "cache" in params else "past_key_values"
    use_output_router_logits = not routers
    if use_output_router_logits and "output_router_logits" not in params:
        raise InputError(where, "model", getattr(config, "model_type", "?"),
                         "not a mixture-of-experts model (it has no router to record)")

    # Per forward: captured[i] = list of (ids, weights) per call of router i.
    captured: list[list] = [[] for _ in routers]
    handles = []
    for i, (_, module, logits_index) in enumerate(routers):
        def hook(_module, _args, output, i=i, logits_index=logits_index):
            captured[i].append(_strongest_first(*routing.from_output(output, logits_index)))
        handles.append(module.register_forward_hook(hook))

    def forward(input_ids, cache):
        for calls in captured:
            calls.clear()
        kwargs = {"input_ids": torch.tensor([input_ids], dtype=torch.long), "use_cache": True, cache_kw: cache}
        if "logits_to_keep" in params:
            kwargs["logits_to_keep"] = 1
        if use_output_router_logits:
            kwargs["output_router_logits"] = True
        out = model(**kwargs)
        n = len(input_ids)
        if use_output_router_logits:
            layers = [_strongest_first(*routing.from_logits_tensor(t)) for t in (out.router_logits or ())]
        else:
            layers = []
            for calls in captured:
                if not calls:  # a router that did not run on this forward: a cell we cannot fill
                    layers.append(None)
                    continue
                ids = np.concatenate([c[0] for c in calls])
                weights = np.concatenate([c[1] for c in calls])
                layers.append((ids, weights))
        for layer in layers:
            if layer is not None and layer[0].shape[0] != n:
                raise InputError(where, "router output", tuple(layer[0].shape),
                                 f"expected one routing row per token ({n})")
        next_cache = getattr(out, "cache", None)
        if next_cache is None:
            next_cache = getattr(out, "past_key_values", None)
        next_token = int(torch.argmax(out.logits[0, -1].float()).item())
        return layers, next_cache, next_token

    rows_experts, rows_request, rows_position, rows_phase = [], [], [], []
    try:
        with torch.no_grad():
            for request in range(requests):
                ids = _prompt_ids(prompt, prompt_tokens, vocab, seed, request, tokenizer)
                steps = [(ids, PHASE_PREFILL, 0)]
                layers, cache, token = forward(ids, None)
                step_layers = [layers]
                for step in range(decode_tokens):
                    layers, cache, token = forward([token], cache)
                    steps.append(([token], PHASE_DECODE, len(ids) + step))
                    step_layers.append(layers)
                for (tokens, phase, start), layers in zip(steps, step_layers):
                    rows_experts.append(layers)
                    n = len(tokens)
                    rows_request.append(np.full(n, request, np.int32))
                    rows_position.append(np.arange(start, start + n, dtype=np.int32))
                    rows_phase.append(np.full(n, phase, np.uint8))
    finally:
        for handle in handles:
            handle.remove()

    # -- assemble [rows, layers, k]
    n_layers = max((len(layers) for layers in rows_experts), default=0)
    if n_layers == 0:
        raise InputError(where, "model", getattr(config, "model_type", "?"),
                         "not a mixture-of-experts model (no router logits were produced)")
    shapes = {layer[0].shape[1] for layers in rows_experts for layer in layers if layer is not None}
    if len(shapes) != 1:
        raise InputError(where, "top_k", sorted(shapes), "layers route to different numbers of experts")
    top_k = shapes.pop()
    n_experts = n_experts_cfg
    if n_experts is None and routers:
        n_experts = getattr(routers[0][1], "num_experts", None)
    if n_experts is None:
        raise InputError(where, "n_experts", None, "the config names no number of experts")
    max_id = max(int(layer[0].max()) for layers in rows_experts for layer in layers if layer is not None)
    if max_id >= n_experts:
        raise InputError(where, "n_experts", n_experts, f"the router chose expert {max_id}")

    blocks_e, blocks_w = [], []
    for layers, req in zip(rows_experts, rows_request):
        n = len(req)
        experts = np.full((n, n_layers, top_k), MISSING, dtype=np.uint16)
        weights = np.zeros((n, n_layers, top_k), dtype=np.float32)
        for j, layer in enumerate(layers):
            if layer is not None:
                experts[:, j] = layer[0]
                weights[:, j] = layer[1]
        blocks_e.append(experts)
        blocks_w.append(weights)

    moe_layers = [_layer_index(name) for name, _, _ in routers] if routers else None
    generator = {
        "recorder": "transformers",
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "seed": seed,
        "requests": requests,
        "prompt": "text" if prompt is not None else "random",
        "prompt_tokens": None if prompt is not None else int(prompt_tokens),
        "decode_tokens": decode_tokens,
        "decoding": "greedy, no early stop",
        "model_type": getattr(model.config, "model_type", None),
        "architecture": type(model).__name__,
        "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
        "moe_layers": moe_layers,
        "router_modules": [name for name, _, _ in routers] if routers else None,
        "routing_source": ("output_router_logits" if use_output_router_logits
                           else "router_logits" if routing.from_logits else "router_topk"),
        "norm_topk_prob": routing.normalise if (use_output_router_logits or routing.from_logits) else None,
    }
    header = TraceHeader(
        model=_model_name(model_dir, model.config),
        n_layers=n_layers,
        n_experts=int(n_experts),
        top_k=int(top_k),
        source=str(model_path),
        source_sha256=model_sha256(model_dir),
        generator=generator,
    )
    trace = Trace(header, np.concatenate(rows_request), np.concatenate(rows_position),
                  np.concatenate(rows_phase), np.concatenate(blocks_e), np.concatenate(blocks_w))
    return trace.validate(where)
