"""`record_trace`: routing traces recorded from tiny, randomly initialised HF MoE models built in the test.

The oracles do not use the recorder's code: layer 0 of the prefill is recomputed in numpy from the
safetensors file (embedding, RMSNorm, RoPE attention, RMSNorm, gate); every row of every MoE layer is
recomputed from the gate inputs seen during transformers' own `generate()` and the gate weights on disk.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys

import numpy as np
import pytest

from tests.conftest import require  # noqa: E402

torch = require("torch", "recording needs the 'record' extra (torch)")
transformers = require("transformers", "recording needs the 'record' extra (transformers)")

from sim.errors import InputError  # noqa: E402
from sim.trace import record as record_mod  # noqa: E402
from sim.trace.format import MISSING, PHASE_DECODE, PHASE_PREFILL, read_trace, write_trace  # noqa: E402
from sim.trace.record import record_trace  # noqa: E402

PROMPT = "the big cat sat on the red mat and the small dog ran away"
WORDS = ["<unk>", "<s>", "</s>"] + sorted(set(PROMPT.split()) | {"a", "from", "blue"})


def _save_tokenizer(path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(path)


def _build(path, config_cls, model_cls, tokenizer=True, **kwargs):
    common = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2)
    common.update(kwargs)
    torch.manual_seed(1234)
    model = model_cls(config_cls(**common)).eval()
    model.save_pretrained(path)
    if tokenizer:
        _save_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    from transformers import MixtralConfig, MixtralForCausalLM

    return _build(tmp_path_factory.mktemp("mixtral"), MixtralConfig, MixtralForCausalLM,
                  num_hidden_layers=3, num_local_experts=8, num_experts_per_tok=2)


@pytest.fixture(scope="module")
def qwen2moe(tmp_path_factory):
    """Layer 1 is dense (mlp_only_layers); the top-k gate weights are not renormalised."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    return _build(tmp_path_factory.mktemp("qwen2moe"), Qwen2MoeConfig, Qwen2MoeForCausalLM,
                  num_hidden_layers=3, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=16,
                  shared_expert_intermediate_size=16, mlp_only_layers=[1], norm_topk_prob=False)


MODELS = {  # fixture name -> (MoE decoder layers, top-k renormalised)
    "mixtral": ([0, 1, 2], True),
    "qwen2moe": ([0, 2], False),
}


@pytest.fixture(params=sorted(MODELS))
def arch(request):
    return request.param, request.getfixturevalue(request.param)


# ------------------------------------------------------------------------------------------- oracles


def _tensors(model_dir):
    from safetensors.numpy import load_file

    out = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        out.update({k: v.astype(np.float64) for k, v in load_file(str(f)).items()})
    return out


def _gate_weight(tensors, layer):
    keys = [k for k in tensors if re.fullmatch(rf"model\.layers\.{layer}\.(mlp|block_sparse_moe)\.gate\.weight", k)]
    assert len(keys) == 1, keys
    return tensors[keys[0]]


def _rms(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _topk(logits, k, renormalise):
    """(ids, weights, comparable) per row: softmax top-k; comparable where no near-tie decides the pick."""
    z = logits - logits.max(-1, keepdims=True)
    probs = np.exp(z) / np.exp(z).sum(-1, keepdims=True)
    order = np.argsort(-probs, axis=-1, kind="stable")
    sorted_p = np.take_along_axis(probs, order, -1)
    ids, w = order[:, :k], sorted_p[:, :k]
    if renormalise:
        w = w / w.sum(-1, keepdims=True)
    comparable = np.diff(-sorted_p[:, : k + 1], axis=-1).min(-1) > 1e-5
    return ids, w, comparable


def _layer0_numpy(model_dir, token_ids, renormalise):
    """Layer-0 routing for the prompt, recomputed from the weights on disk with plain numpy."""
    cfg = json.loads((model_dir / "config.json").read_text())
    t = _tensors(model_dir)
    p = "model.layers.0."
    eps = cfg["rms_norm_eps"]
    n_heads, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg["hidden_size"] // n_heads
    theta = (cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta"))
    n = len(token_ids)

    x = t["model.embed_tokens.weight"][token_ids]
    h = _rms(x, t[p + "input_layernorm.weight"], eps)

    def proj(name):
        y = h @ t[p + f"self_attn.{name}.weight"].T
        return y + t.get(p + f"self_attn.{name}.bias", 0.0)

    q = proj("q_proj").reshape(n, n_heads, hd)
    k = proj("k_proj").reshape(n, n_kv, hd)
    v = proj("v_proj").reshape(n, n_kv, hd)
    inv = 1.0 / theta ** (np.arange(0, hd, 2) / hd)
    ang = np.arange(n)[:, None] * inv[None, :]
    cos = np.cos(np.concatenate([ang, ang], -1))[:, None, :]
    sin = np.sin(np.concatenate([ang, ang], -1))[:, None, :]

    def rope(a):
        rotated = np.concatenate([-a[..., hd // 2:], a[..., : hd // 2]], -1)
        return a * cos + rotated * sin

    q, k = rope(q), rope(k)
    k = np.repeat(k, n_heads // n_kv, axis=1)
    v = np.repeat(v, n_heads // n_kv, axis=1)
    scores = np.einsum("ihd,jhd->hij", q, k) / np.sqrt(hd)
    scores = np.where(np.tril(np.ones((n, n), bool))[None], scores, -np.inf)
    att = np.exp(scores - scores.max(-1, keepdims=True))
    att /= att.sum(-1, keepdims=True)
    out = np.einsum("hij,jhd->ihd", att, v).reshape(n, n_heads * hd)
    x = x + out @ t[p + "self_attn.o_proj.weight"].T
    y = _rms(x, t[p + "post_attention_layernorm.weight"], eps)
    return _topk(y @ _gate_weight(t, 0).T, cfg["num_experts_per_tok"], renormalise)


def _generate_oracle(model_dir, token_ids, decode_tokens, moe_layers, renormalise):
    """Routing of every row and MoE layer, from the gate inputs transformers' own generate() produces."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True).eval()
    model.generation_config.eos_token_id = None  # the recorder never stops early either
    seen = {layer: [] for layer in moe_layers}
    hooks = [model.model.layers[layer].post_attention_layernorm.register_forward_hook(
        lambda _m, _a, out, layer=layer: seen[layer].append(out.detach().reshape(-1, out.shape[-1]).double().numpy()))
        for layer in moe_layers]
    with torch.no_grad():
        out = model.generate(torch.tensor([token_ids]), max_new_tokens=decode_tokens + 1, do_sample=False,
                             pad_token_id=0)
    for h in hooks:
        h.remove()
    assert out.shape[1] == len(token_ids) + decode_tokens + 1
    t = _tensors(model_dir)
    k = model.config.num_experts_per_tok
    return [_topk(np.concatenate(seen[layer]) @ _gate_weight(t, layer).T, k, renormalise) for layer in moe_layers]


def _assert_routing_equal(trace_ids, trace_w, oracle):
    ids, w, comparable = oracle
    assert trace_ids.shape == ids.shape
    assert comparable.mean() > 0.9, "too many near-ties for the oracle to mean anything"
    np.testing.assert_array_equal(np.sort(trace_ids[comparable], -1), np.sort(ids[comparable], -1))
    np.testing.assert_array_equal(trace_ids[comparable], ids[comparable])
    np.testing.assert_allclose(trace_w[comparable], w[comparable], atol=2e-5)


def _prompt_ids(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)(PROMPT)["input_ids"]


# --------------------------------------------------------------------------------------------- tests


def test_shape_phases_positions_and_ids(mixtral):
    p, d = 6, 4
    trace = record_trace(mixtral, prompt_tokens=p, decode_tokens=d, seed=3, requests=2)
    h = trace.header
    assert (h.n_layers, h.n_experts, h.top_k) == (3, 8, 2)
    assert trace.experts.shape == (2 * (p + d), 3, 2) and trace.weights.shape == trace.experts.shape
    one = np.r_[np.full(p, PHASE_PREFILL), np.full(d, PHASE_DECODE)]
    np.testing.assert_array_equal(trace.phase, np.r_[one, one])
    np.testing.assert_array_equal(trace.position, np.r_[np.arange(p + d), np.arange(p + d)])
    np.testing.assert_array_equal(trace.request, np.repeat([0, 1], p + d))
    assert not (trace.experts == MISSING).any()
    assert (trace.experts < h.n_experts).all()
    assert (trace.experts[:, :, 0] != trace.experts[:, :, 1]).all()  # distinct experts within a cell
    np.testing.assert_allclose(trace.weights.sum(-1), 1.0, atol=1e-5)  # Mixtral renormalises its top-k
    assert (np.diff(trace.weights, axis=-1) <= 0).all()  # strongest expert first
    # The two requests have different random prompts, so (almost surely) different routing.
    assert not np.array_equal(trace.experts[: p + d], trace.experts[p + d:])


def test_header(mixtral):
    trace = record_trace(mixtral, prompt_tokens=3, decode_tokens=1, seed=7)
    h = trace.header
    assert h.source == str(mixtral)
    digest = hashlib.sha256()
    for f in sorted([mixtral / "config.json", *mixtral.glob("*.safetensors")], key=lambda f: f.name):
        digest.update(f.read_bytes())
    assert h.source_sha256 == digest.hexdigest()
    g = h.generator
    assert g["recorder"] == "transformers" and g["seed"] == 7
    assert g["transformers"] == transformers.__version__ and g["torch"] == torch.__version__
    assert g["model_type"] == "mixtral" and g["moe_layers"] == [0, 1, 2]
    assert h.model


def test_deterministic_and_seeded(mixtral):
    a = record_trace(mixtral, prompt_tokens=8, decode_tokens=5, seed=11)
    b = record_trace(mixtral, prompt_tokens=8, decode_tokens=5, seed=11)
    c = record_trace(mixtral, prompt_tokens=8, decode_tokens=5, seed=12)
    assert a.sha256() == b.sha256()
    np.testing.assert_array_equal(a.experts, b.experts)
    np.testing.assert_array_equal(a.weights, b.weights)
    assert not np.array_equal(a.experts, c.experts)


def test_layer0_prefill_matches_numpy_forward(arch):
    name, model_dir = arch
    layers, renormalise = MODELS[name]
    ids = _prompt_ids(model_dir)
    trace = record_trace(model_dir, prompt=PROMPT, decode_tokens=0)
    assert trace.n_rows == len(ids) and (trace.phase == PHASE_PREFILL).all()
    _assert_routing_equal(trace.experts[:, 0].astype(np.int64), trace.weights[:, 0],
                          _layer0_numpy(model_dir, ids, renormalise))


def test_every_row_and_layer_matches_generate(arch):
    name, model_dir = arch
    layers, renormalise = MODELS[name]
    ids, d = _prompt_ids(model_dir), 6
    trace = record_trace(model_dir, prompt=PROMPT, decode_tokens=d, requests=2)
    assert trace.header.n_layers == len(layers) and trace.header.generator["moe_layers"] == layers
    one = trace.rows(trace.request == 0)
    assert one.n_rows == len(ids) + d
    np.testing.assert_array_equal(one.position, np.arange(len(ids) + d))
    # The same text prompt twice: the second request repeats the first.
    np.testing.assert_array_equal(one.experts, trace.experts[trace.request == 1])
    oracle = _generate_oracle(model_dir, ids, d, layers, renormalise)
    for j in range(len(layers)):
        _assert_routing_equal(one.experts[:, j].astype(np.int64), one.weights[:, j], oracle[j])
    if not renormalise:  # Qwen2-MoE with norm_topk_prob = False: raw softmax probabilities
        assert (one.weights.sum(-1) < 1).all()


def test_output_router_logits_fallback_agrees(arch, monkeypatch):
    """Without router modules to hook (older transformers) the model's output_router_logits gives the same."""
    name, model_dir = arch
    hooked = record_trace(model_dir, prompt_tokens=5, decode_tokens=3)
    monkeypatch.setattr(record_mod, "_find_routers", lambda model: [])
    fallback = record_trace(model_dir, prompt_tokens=5, decode_tokens=3)
    assert fallback.header.generator["routing_source"] == "output_router_logits"
    np.testing.assert_array_equal(hooked.experts, fallback.experts)
    np.testing.assert_allclose(hooked.weights, fallback.weights, atol=1e-6)


def test_write_and_read_back(qwen2moe, tmp_path):
    trace = record_trace(qwen2moe, prompt_tokens=5, decode_tokens=2, requests=2, seed=5)
    path = tmp_path / "t.parquet"
    write_trace(trace, path)
    back = read_trace(path)
    assert back.header == trace.header and back.sha256() == trace.sha256()
    np.testing.assert_array_equal(back.experts, trace.experts)
    np.testing.assert_array_equal(back.weights, trace.weights)


def test_decode_zero_gives_prefill_only(mixtral):
    trace = record_trace(mixtral, prompt_tokens=4, decode_tokens=0)
    assert trace.n_rows == 4 and (trace.phase == PHASE_PREFILL).all()


@pytest.mark.parametrize("kwargs, field", [
    (dict(prompt="the cat", prompt_tokens=3), "prompt"),
    (dict(), "prompt"),
    (dict(prompt_tokens=4, decode_tokens=-1), "decode_tokens"),
    (dict(prompt_tokens=0), "prompt_tokens"),
    (dict(prompt_tokens=4, requests=0), "requests"),
    (dict(prompt_tokens=4, seed=-1), "seed"),
])
def test_bad_options(mixtral, kwargs, field):
    with pytest.raises(InputError) as err:
        record_trace(mixtral, **kwargs)
    assert err.value.field == field


def test_missing_path_and_not_a_model_dir(tmp_path):
    with pytest.raises(InputError, match="no such directory"):
        record_trace(tmp_path / "nope", prompt_tokens=3)
    with pytest.raises(InputError, match="config.json"):
        record_trace(tmp_path, prompt_tokens=3)


def test_dense_model_is_not_moe(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    model_dir = _build(tmp_path / "llama", LlamaConfig, LlamaForCausalLM, tokenizer=False, num_hidden_layers=2)
    with pytest.raises(InputError, match="not a mixture-of-experts"):
        record_trace(model_dir, prompt_tokens=3)


def test_text_prompt_needs_tokenizer(tmp_path):
    from transformers import MixtralConfig, MixtralForCausalLM

    model_dir = _build(tmp_path / "m", MixtralConfig, MixtralForCausalLM, tokenizer=False,
                       num_hidden_layers=1, num_local_experts=4, num_experts_per_tok=2)
    with pytest.raises(InputError, match="tokenizer"):
        record_trace(model_dir, prompt="the cat")
    assert record_trace(model_dir, prompt_tokens=2, decode_tokens=1).n_rows == 3


def test_missing_extra_says_how_to_install(mixtral, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(InputError, match=r"pip install 'expertsim\[record\]'"):
        record_trace(mixtral, prompt_tokens=3)


@pytest.mark.parametrize("name", ["deepseek_v3", "gpt_oss"])
def test_other_architectures_smoke(name, tmp_path):
    """Sigmoid, group-limited routing with a dense first layer (DeepSeek-V3); biased router (gpt-oss)."""
    import transformers as T

    if name == "deepseek_v3":
        model_dir = _build(tmp_path / name, T.DeepseekV3Config, T.DeepseekV3ForCausalLM, tokenizer=False,
                           num_hidden_layers=3, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2,
                           n_group=2, topk_group=1, first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16,
                           qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, moe_intermediate_size=16)
        layers, n_experts = [1, 2], 8
    else:
        model_dir = _build(tmp_path / name, T.GptOssConfig, T.GptOssForCausalLM, tokenizer=False,
                           num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2, head_dim=8)
        layers, n_experts = [0, 1], 4
    trace = record_trace(model_dir, prompt_tokens=5, decode_tokens=3)
    h = trace.header
    assert (h.n_layers, h.n_experts, h.top_k) == (len(layers), n_experts, 2)
    assert h.generator["moe_layers"] == layers and h.generator["routing_source"] == "router_topk"
    assert trace.experts.shape == (8, len(layers), 2)
    assert (trace.experts < n_experts).all() and (trace.experts[..., 0] != trace.experts[..., 1]).all()
    if name == "deepseek_v3":  # both picks come from the one group the token was limited to
        assert ((trace.experts[..., 0] // 4) == (trace.experts[..., 1] // 4)).all()
