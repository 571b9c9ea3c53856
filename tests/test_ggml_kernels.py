"""sim/calibrate/ggml_kernels.py (the measurement of ggml's CPU kernels per type) and sim/engines/llamacpp/kernels.py
(the engine's use of its figures)."""

from __future__ import annotations

import numpy as np
import pytest

from sim.calibrate import ggml_kernels as gk
from sim.engines.llamacpp import kernels
from sim.engines.records import BY_ID, GGML_KERNEL_GBPS, Domain, ggml_kernel_record_id
from sim.model.quant import QUANT_TYPES


def test_rates_recover_the_kernels_times_were_made_of():
    # times of the 8- and 16-layer models made from chosen rates (GB/s of one core), a fixed cost per token outside
    # the layers, and the bytes a layer reads worked out by hand: attention 2048 x (4096 + 2 x 512) + 4096 x 2048 =
    # 18,874,368 weights at Q8_0 (34 bytes per 32) = 20,054,016 B; 8 experts x 3 x 2048 x 768 weights, Q8_0
    # 40,108,032 B, Q4_K (144 bytes per 256) 21,233,664 B
    q8, q4k, fixed = 19.0e9, 8.0e9, 0.012
    attention, experts_q8, experts_q4k = 20_054_016, 40_108_032, 21_233_664
    layer_q8 = (attention + experts_q8) / q8
    layer_q4k = attention / q8 + experts_q4k / q4k
    seconds = {"Q8_0": (fixed + 8 * layer_q8, fixed + 16 * layer_q8),
               "Q4_K": (fixed + 8 * layer_q4k, fixed + 16 * layer_q4k)}
    got = gk.rates(seconds)
    assert got["Q8_0"] == pytest.approx(19.0)
    assert got["Q4_K"] == pytest.approx(8.0)


def test_the_synthetic_model_has_the_shapes_llama_cpp_loads(tmp_path):
    gguf = pytest.importorskip("gguf")
    vocab = tmp_path / "vocab.gguf"
    writer = gguf.GGUFWriter(str(vocab), "qwen3moe")
    tokens = [f"t{i}" for i in range(64)]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * len(tokens))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    path = tmp_path / "m.gguf"
    gk.write_model(path, 1, vocab)
    reader = gguf.GGUFReader(str(path))
    shapes = {t.name: (t.tensor_type.name, [int(x) for x in t.shape]) for t in reader.tensors}
    # qwen3moe's tensors as llama.cpp creates them (src/models/qwen3moe.cpp: gate/up {n_embd, n_ff_exp, n_expert},
    # down {n_ff_exp, n_embd, n_expert}; ggml's order, innermost first)
    assert shapes["blk.0.ffn_gate_exps.weight"] == ("Q8_0", [2048, 768, 16])
    assert shapes["blk.0.ffn_up_exps.weight"] == ("Q8_0", [2048, 768, 16])
    assert shapes["blk.0.ffn_down_exps.weight"] == ("Q8_0", [768, 2048, 16])
    assert shapes["blk.0.attn_q.weight"] == ("Q8_0", [2048, 4096])
    assert shapes["blk.0.attn_k.weight"] == ("Q8_0", [2048, 512])
    assert shapes["token_embd.weight"] == ("Q8_0", [2048, 64])
    fields = reader.fields
    assert int(fields["qwen3moe.expert_used_count"].contents()) == 8
    assert fields["tokenizer.ggml.tokens"].contents() == tokens
    gate = next(t for t in reader.tensors if t.name == "blk.0.ffn_gate_exps.weight")
    assert int(gate.n_bytes) == 16 * 768 * 2048 // 32 * 34


@pytest.mark.parametrize("type_name", sorted(kernels.MEASURED_AS))
@pytest.mark.parametrize("build", ["ggml", "ik"])
def test_every_type_llama_cpp_runs_on_a_measured_kernel(type_name, build):
    """Each type mainline loads runs on a measured kernel of either build on every measured instruction set; ik's own
    types (only ik loads them) on ik's, where ik was measured, and on none elsewhere (the profile's figure then)."""
    ik_isas = {isa for b, isa, _ in GGML_KERNEL_GBPS if b == "ik"}
    for isa in kernels.MEASURED_ISAS:
        kernel = kernels.measured_kernel(build, isa, type_name)
        if kernel is None:
            assert QUANT_TYPES[type_name].fork is not None and (build != "ik" or isa not in ik_isas), (build, isa)
            continue
        kernel_build, measured = kernel
        record = BY_ID[ggml_kernel_record_id(kernel_build, isa, measured)]
        assert record.unit == "GB/s" and record.value > 0 and record.engine == "llama.cpp"
        assert measured in (type_name, kernels.MEASURED_AS[type_name])


def test_ik_llama_cpp_runs_its_own_kernels_where_measured_and_mainlines_elsewhere():
    measured_by_ik = {(isa, t) for build, isa, t in GGML_KERNEL_GBPS if build == "ik"}
    assert ("avx512", "IQ3_XXS") in measured_by_ik  # its own, not its family's (mainline has IQ3_S only)
    assert kernels.measured_kernel("ik", "avx512", "IQ3_XXS") == ("ik", "IQ3_XXS")
    assert kernels.measured_kernel("ggml", "avx512", "IQ3_XXS") == ("ggml", "IQ3_S")
    notices = []
    domain = Domain("llama.cpp", "m", "h", None)
    ik_q8 = kernels.expert_core_rate(np.array([1e6] * 3), np.array(["Q8_0"] * 3), "avx512", domain, notices, "ik")
    assert ik_q8 == pytest.approx(GGML_KERNEL_GBPS["ik", "avx512", "Q8_0"] * 1e9) and notices == []
    # no ik measurement on AVX2: mainline's kernel, said once
    rate = kernels.expert_core_rate(np.array([1e6] * 3), np.array(["Q8_0"] * 3), "avx2", domain, notices, "ik")
    assert rate == pytest.approx(GGML_KERNEL_GBPS["ggml", "avx2", "Q8_0"] * 1e9)
    assert notices == ["no measured ik_llama.cpp CPU kernel for Q8_0 on avx2: mainline ggml's Q8_0 kernel stands in"]


def test_ik_llama_cpp_quantize_takes_its_own_flags():
    assert gk.expert_type_flags("IQ3_XXS", ik=True) == [
        "--custom-q", "ffn_gate_exps=iq3_xxs,ffn_up_exps=iq3_xxs,ffn_down_exps=iq3_xxs"]
    assert gk.expert_type_flags("Q4_K", ik=False) == [
        "--tensor-type", "ffn_gate_exps=q4_K", "--tensor-type", "ffn_up_exps=q4_K", "--tensor-type",
        "ffn_down_exps=q4_K"]  # ggml's spelling of the type (ggml.c type_traits), which ik's parser requires


# ggml.c type_traits' type_name of each type ik_llama.cpp@8337e4cd3 has (its quantize's --custom-q takes no other
# spelling): the k-quants with a capital K, every other type in lower case
IK_TYPE_NAMES = {"Q8_0": "q8_0", "Q5_0": "q5_0", "Q4_K": "q4_K", "Q6_K": "q6_K", "Q8_K": "q8_K", "IQ3_XXS": "iq3_xxs",
                 "IQ4_XS": "iq4_xs", "MXFP4": "mxfp4", "Q6_0": "q6_0", "IQ2_K": "iq2_k", "IQ4_K": "iq4_k",
                 "IQ6_K": "iq6_k", "IQ3_KS": "iq3_ks", "IQ4_KS": "iq4_ks", "IQ2_KL": "iq2_kl"}


@pytest.mark.parametrize("type_name", sorted(IK_TYPE_NAMES))
def test_quantize_names_each_type_as_ggml_does(type_name):
    rules = gk.expert_type_flags(type_name, ik=True)[1].split(",")
    assert rules == [f"ffn_{part}_exps={IK_TYPE_NAMES[type_name]}" for part in ("gate", "up", "down")]


def test_an_expert_of_two_types_takes_the_time_of_each_slice():
    domain = Domain("llama.cpp", "m", "h", None)
    q8 = BY_ID[ggml_kernel_record_id("ggml", "avx512", "Q8_0")].value * 1e9
    q6k = BY_ID[ggml_kernel_record_id("ggml", "avx512", "Q6_K")].value * 1e9
    parts, types = np.array([100.0, 100.0, 300.0]), np.array(["Q8_0", "Q8_0", "Q6_K"])
    rate = kernels.expert_core_rate(parts, types, "avx512", domain, [])
    assert rate == pytest.approx(500.0 / (200.0 / q8 + 300.0 / q6k))
    # measured elsewhere: every run says so
    assert any("llamacpp-ggml-avx512-q8_0" in note for note in domain.out_of_domain())


def test_a_cpu_without_a_measurement_runs_at_the_profiles_figure_and_says_so():
    notices = []
    rate = kernels.expert_core_rate(np.array([1.0, 1.0, 1.0]), np.array(["Q8_0"] * 3), "neon",
                                    Domain("llama.cpp", "m", "h", None), notices)
    assert rate is None  # the machine's own figure (sim/machine Machine.cpu_expert_matmul)
    assert notices == ["no measured ggml CPU kernels for host.simd neon: the CPU expert matmul runs at the profile's "
                       "host.expert_kernel_gbps per core"]


def _rates(**gbps):
    """The machine's own_ggml_kernel for a profile whose host.ggml_kernel_gbps holds these figures (GB/s)."""
    return {t: v * 1e9 for t, v in gbps.items()}.get


def test_a_host_measured_on_itself_runs_its_own_rates_then_its_familys_then_the_records():
    """host.ggml_kernel_gbps: a slice of a type the host measured runs at that rate, one of its family (Q6_0 is
    Q8_0's) at the family's, any other at the record; the expert's rate is its bytes over the sum of the times."""
    domain, notices = Domain("llama.cpp", "m", "h", None), []
    own = _rates(Q8_0=2.0)
    rate = kernels.expert_core_rate(np.array([1e6, 1e6, 2e6]), np.array(["Q8_0", "Q6_0", "Q4_K"]), "avx512", domain,
                                    notices, "ggml", own)
    q4k = BY_ID[ggml_kernel_record_id("ggml", "avx512", "Q4_K")].value
    assert rate == pytest.approx(4e6 / (1e6 / 2e9 + 1e6 / 2e9 + 2e6 / (q4k * 1e9)))
    # no instruction set measured: the host's own rates still hold where it has them, without a notice
    assert kernels.expert_core_rate(np.array([1e6] * 3), np.array(["Q8_0"] * 3), None, domain, notices, "ggml",
                                    own) == pytest.approx(2e9) and notices == []


def test_ik_keeps_its_own_measured_kernels_and_takes_the_hosts_for_the_rest():
    domain, notices = Domain("llama.cpp", "m", "h", None), []
    own = _rates(Q8_0=2.0, IQ3_S=1.0)
    ik_q8 = GGML_KERNEL_GBPS["ik", "avx512", "Q8_0"] * 1e9
    assert kernels.expert_core_rate(np.array([1e6] * 3), np.array(["Q8_0"] * 3), "avx512", domain, notices, "ik",
                                    own) == pytest.approx(ik_q8)
    # IQ3_S: no ik row on AVX-512, so the host's own (mainline) rate, not mainline's record
    assert kernels.expert_core_rate(np.array([1e6] * 3), np.array(["IQ3_S"] * 3), "avx512", domain, notices, "ik",
                                    own) == pytest.approx(1e9)


def test_a_type_the_build_cannot_write_is_skipped_and_the_rest_measured(tmp_path):
    """measure() with stand-in binaries (the models already in place): llama-quantize refusing one type leaves that
    type out, with the tool's last line, and the other types are still timed and rated."""
    bin_dir, work = tmp_path / "bin", tmp_path / "work"
    bin_dir.mkdir()
    work.mkdir()
    for n in gk.LAYER_PAIR:
        (work / f"L{n}.gguf").write_bytes(b"")
    quantize = bin_dir / "llama-quantize"
    quantize.write_text('#!/bin/sh\ncase "$*" in *iq4_k,*) echo "invalid type iq4_k" >&2; exit 1;; esac\n'
                        'eval src=\\${$(($# - 2))} dst=\\${$(($# - 1))}\ncp "$src" "$dst"\n')
    bench = bin_dir / "llama-bench"  # 20 ms a token for an 8-layer model, 30 for a 16-layer one
    bench.write_text('#!/bin/sh\ncase "$*" in *L16*) ts=33.333;; *) ts=50;; esac\n'
                     'echo "[{\\"samples_ts\\": [$ts]}]"\n')
    for tool in (quantize, bench):
        tool.chmod(0o755)
    result = gk.measure(tmp_path, bin_dir, work, types=("IQ4_K", "Q4_K"), ik=True)
    assert set(result["seconds_per_token"]) == {"Q8_0", "Q4_K"}
    assert result["skipped"] == {"IQ4_K": "llama-quantize exit 1: invalid type iq4_k"}
    assert result["gbps_per_core"]["Q8_0"] == pytest.approx(sum(gk.layer_bytes("Q8_0")) / (0.01 / 8) / 1e9, rel=1e-3)
