"""The benchmark's workloads and floors on the numpy backend (speed itself is measured by `make bench`, not here)."""

import math
from dataclasses import asdict

import numpy as np
import pytest

from tinyvllm import LLM
from tinyvllm.benchmark import (Storage, decode_gemm_shapes, dummy_model, workload_floor, format_results,
                                kv_bytes_per_token, make_workload, matmul_params, run_benchmark, run_j1, run_storage,
                                weight_bytes)
from tinyvllm.model.dtypes import bf16_to_f32
from tinyvllm.model.dummy import PRESETS, RandomBf16Weights, llama_3_2_1b_config, save_hf_model_dir, tiny_config
from tinyvllm.model.loader import Bf16Bytes, as_bf16, load_model, weight_shapes


def test_workload_shapes():
    w1 = make_workload("W1", 1000)
    assert len(w1) == 512 and {len(r.prompt_token_ids) for r in w1} == {256} and {r.max_tokens for r in w1} == {256}
    w2 = make_workload("W2", 1000)
    assert len(w2) == 256 and all(100 <= len(r.prompt_token_ids) <= 1024 and 100 <= r.max_tokens <= 1024 for r in w2)
    w5 = make_workload("W5", 1000)
    assert len(w5) == 1024 and all(r.prompt_token_ids[:1024] == w5[0].prompt_token_ids[:1024] for r in w5)
    assert len({tuple(r.prompt_token_ids[1024:]) for r in w5}) > 1000


def test_llama_1b_floor_matches_the_known_limits():
    config = llama_3_2_1b_config()
    assert abs(weight_bytes(config) / 1e9 - 2.47) < 0.01  # 1.24 B parameters in bf16
    # batch-1 decode is bound by reading the weights: ~0.58 ms per token at 4.27 TB/s
    w3 = workload_floor(config, make_workload("W3", config.vocab_size), 4.27e12, 7.4e14, 512)
    assert 0.55e-3 < w3.seconds / 256 < 0.65e-3
    assert w3.decode_flops_s == 0 and w3.decode_kv_s < w3.decode_weights_s / 10 and w3.prefill_flops_s > 0
    w5 = make_workload("W5", config.vocab_size)
    assert workload_floor(config, w5, 4.27e12, 7.4e14, 512, cached_prefix=1024).seconds < \
        workload_floor(config, w5, 4.27e12, 7.4e14, 512).seconds / 3
    w1 = workload_floor(config, make_workload("W1", 100), 4.27e12, 7.4e14, 512)
    assert matmul_params(config) * 2 * 512 * 256 / 7.4e14 < w1.seconds
    # W1's 512 sequences of 256-512 tokens: the KV cache outweighs the weights a step reads
    assert w1.decode_kv_s > w1.decode_weights_s > 0
    # a thousand-fold slower GEMM rate makes every decode step compute-bound
    slow = workload_floor(config, make_workload("W1", 100), 4.27e12, 7.4e11, 512)
    assert slow.decode_weights_s == slow.decode_kv_s == 0 and slow.decode_flops_s > 0
    assert slow.seconds == pytest.approx(sum(asdict(slow).values()))


def test_run_benchmark_on_the_cpu():
    llm = LLM(dummy_model("tiny"), backend="numpy", max_num_seqs=32)
    results = run_benchmark(llm, ["W1", "W2", "W3", "W4", "W5"], scale=0.02)
    work = results["workloads"]
    assert work["W1"]["output_tokens"] == sum(r.max_tokens for r in make_workload("W1", 1, 0.02))
    assert work["W3"]["ms_per_token"] > 0 and work["W4"]["achieved_tflops"] > 0
    assert work["W5"]["speedup_vs_cache_off"] > 0 and work["W5"]["cache_off"]["output_tokens"] == \
        work["W5"]["output_tokens"]
    assert work["W2"]["unchunked"]["output_tokens"] == work["W2"]["output_tokens"]
    assert all(0 < r["fraction_of_limit"] for r in work.values())
    assert work["W5"]["fraction_of_limit"] < 1, "the floor must count the prefix cache's savings"
    assert all(r["floor_s"] == pytest.approx(sum(r["floor_parts_s"].values())) for r in work.values())
    assert llm.llm_engine.block_manager.enable_prefix_caching and llm.llm_engine.scheduler.enable_chunked_prefill
    assert "W5" in format_results(results)


def test_run_benchmark_times_after_background_startup(monkeypatch):
    """The limits and the workloads are measured once the backend's background start-up work (the cuda backend's
    lazy graph capture) is done."""
    llm = LLM(dummy_model("tiny"), backend="numpy", max_num_seqs=4)
    calls = []

    def generate(*args, **kwargs):
        calls.append("generate")
        raise InterruptedError  # the first workload has started: enough

    monkeypatch.setattr(llm.backend, "finish_startup", lambda: calls.append("finish_startup"))
    monkeypatch.setattr("tinyvllm.benchmark.measure_limits",
                        lambda backend, fp8=False: calls.append("measure_limits") or {})
    monkeypatch.setattr(llm, "generate", generate)
    with pytest.raises(InterruptedError):
        run_benchmark(llm, ["W3"], scale=0.02)
    assert calls == ["finish_startup", "measure_limits", "generate"]


def test_j1_job_and_engine_give_the_same_tokens():
    """J1's plumbing at a tiny scale: the job (text rows through run_job) and the engine (token ids) get the same
    requests and greedy outputs; max_num_seqs 2 keeps the job's in-flight limit (8) below its 20 rows."""
    llm = LLM(dummy_model("tiny", text=True), backend="numpy", max_num_seqs=2)
    result, requests = run_j1(llm, num_rows=20, max_tokens=4, num_words=12, output_token_ids=True)
    assert result["requests"] == len(requests) == 20 and result["same_outputs"] == 20
    assert result["same_prompt_lengths"] == 20
    assert result["output_tokens"] == result["engine"]["output_tokens"] == 80
    assert result["input_tokens"] == sum(len(r.prompt_token_ids) for r in requests)
    assert result["output_tok_s"] > 0 and result["job_vs_engine"] > 0 and result["finalize_s"] >= 0


# Published parameter counts (embedding included, once when tied) and KV bytes per token in bf16.
BIG_PRESETS = {"llama-3.1-8b": (8_030_261_248, 2 * 32 * 8 * 128 * 2),
               "qwen2.5-7b": (7_615_616_512, 2 * 28 * 4 * 128 * 2)}


def test_fp8_floor_counts_the_bytes_and_the_rate_each_part_runs_at():
    config = llama_3_2_1b_config()
    lm_head, small = config.vocab_size * config.hidden_size, weight_bytes(config) - 2 * matmul_params(config)
    linear = matmul_params(config) - lm_head
    assert weight_bytes(config, storage=Storage(linear_bytes=1)) == linear + 2 * lm_head + small
    assert weight_bytes(config, storage=Storage(linear_bytes=1, lm_head_bytes=1)) == linear + lm_head + small
    w3 = make_workload("W3", config.vocab_size)
    bf16 = workload_floor(config, w3, 4.27e12, 7.4e14, 512)
    fp8 = workload_floor(config, w3, 4.27e12, 7.4e14, 512, storage=Storage(1, 1, 1, 1.48e15))
    assert fp8.decode_weights_s == pytest.approx(bf16.decode_weights_s / 2, rel=1e-3)
    assert fp8.decode_kv_s == pytest.approx(bf16.decode_kv_s / 2)
    # prefill: the linear layers at the FP8 rate, attention at the bf16 one
    attn = sum(4 * 16 * 32 * 64 * len(r.prompt_token_ids) ** 2 / 2 for r in w3) / 7.4e14
    assert fp8.prefill_flops_s - attn == pytest.approx((bf16.prefill_flops_s - attn) / 2)
    # an fp8 LM head only at the FP8 rate when it is quantized too
    head_bf16 = workload_floor(config, w3, 4.27e12, 7.4e14, 512, storage=Storage(1, 2, 2, 1.48e15))
    assert fp8.prefill_flops_s < head_bf16.prefill_flops_s < bf16.prefill_flops_s


@pytest.mark.parametrize("settings, expected", [
    ({}, Storage(2, 2, 2, None)), ({"quantization": "fp8"}, Storage(1, 2, 2, 1e15)),
    ({"quantization": "fp8", "quantize_lm_head": True, "kv_cache_dtype": "fp8"}, Storage(1, 1, 1, 1e15)),
    ({"kv_cache_dtype": "fp8"}, Storage(2, 2, 1, None))])
def test_run_storage_follows_the_engine_settings(settings, expected):
    llm = LLM(dummy_model("tiny"), backend="numpy", **settings)
    assert run_storage(llm, {"fp8_gemm_flops": 1e15}) == expected
    assert run_storage(llm, {}).linear_flops is None  # no FP8 rate measured: the bf16 rate


@pytest.mark.parametrize("preset", [name for name, make in PRESETS.items() if not make().num_experts])
def test_dummy_presets_floors(preset):
    """The dense presets' floors (a mixture-of-experts step reads only the experts its tokens chose)."""
    config = PRESETS[preset]()
    shapes = weight_shapes(config)
    params = sum(math.prod(shape) for name, shape in shapes.items()
                 if not (name == "lm_head.weight" and config.tie_word_embeddings))
    embed = 0 if config.tie_word_embeddings else config.vocab_size * config.hidden_size
    # A decode step reads every tensor but an untied embedding table (it gathers its rows)
    assert weight_bytes(config) == 2 * (params - embed)
    linear = sum(math.prod(shape) for name, shape in shapes.items() if len(shape) == 2 and "embed" not in name)
    assert matmul_params(config) == linear
    if preset in BIG_PRESETS:
        assert (params, kv_bytes_per_token(config)) == BIG_PRESETS[preset]
        assert not config.tie_word_embeddings


# The issue-40 families' presets: their published parameter counts, and the layer ops each needs
FAMILY_PRESETS = {"gemma-2-2b": (2_614_341_888, 2 * 26 * 4 * 256 * 2, "Gemma2ForCausalLM"),
                  "gemma-3-1b": (999_885_952, 2 * 26 * 1 * 256 * 2, "Gemma3ForCausalLM"),
                  "phi-3.5-mini": (3_821_079_552, 2 * 32 * 32 * 96 * 2, "Phi3ForCausalLM")}


@pytest.mark.parametrize("preset", list(FAMILY_PRESETS))
def test_family_presets_are_the_hub_configs(preset):
    config = PRESETS[preset]()
    params = sum(math.prod(shape) for name, shape in weight_shapes(config).items()
                 if not (name == "lm_head.weight" and config.tie_word_embeddings))
    assert (params, kv_bytes_per_token(config), config.architecture) == FAMILY_PRESETS[preset]
    gemma = preset.startswith("gemma")
    assert (config.activation == "gelu_pytorch_tanh") == gemma == config.sandwich_norms == config.tie_word_embeddings
    assert config.final_logit_softcapping == (30.0 if preset == "gemma-2-2b" else None)
    assert (config.rope_scaling or {}).get("rope_type") == (None if gemma else "longrope")


def test_big_presets_shapes():
    llama, qwen = PRESETS["llama-3.1-8b"](), PRESETS["qwen2.5-7b"]()
    assert llama.rope_scaling == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    assert (llama.rope_theta, llama.rms_norm_eps, llama.attention_bias) == (500000.0, 1e-5, False)
    assert qwen.attention_bias and not qwen.qk_norm and qwen.rope_scaling is None
    assert (qwen.rope_theta, qwen.rms_norm_eps) == (1e6, 1e-6)
    model = dummy_model("qwen2.5-7b")  # made lazily: nothing of 7.6 B parameters is generated here
    assert isinstance(model.weights, RandomBf16Weights) and model.weights.shape("lm_head.weight") == (152064, 3584)
    assert model.weights.shape("model.layers.27.self_attn.k_proj.bias") == (512,)


def test_random_bf16_weights(monkeypatch):
    config = tiny_config(architecture="Qwen2ForCausalLM", tie_word_embeddings=True, intermediate_size=1000)
    weights = RandomBf16Weights(config, seed=5)
    assert set(weights) == set(weight_shapes(config)) and len(weights) == len(weight_shapes(config))
    name = "model.layers.1.mlp.down_proj.weight"  # [64, 1000]
    bits = weights.stored(name)
    assert bits.dtype == np.uint16 and bits.shape == (64, 1000)
    np.testing.assert_array_equal(weights[name], bf16_to_f32(bits))
    np.testing.assert_array_equal(RandomBf16Weights(config, seed=5).stored(name), bits)  # in every process alike
    assert not np.array_equal(RandomBf16Weights(config, seed=6).stored(name), bits)
    assert not np.array_equal(weights.stored("model.layers.0.mlp.down_proj.weight"), bits)
    np.testing.assert_array_equal(weights.stored("lm_head.weight"), weights.stored("model.embed_tokens.weight"))
    # The CUDA upload takes the bit patterns as they are: never the float32 view
    with monkeypatch.context() as patch:
        patch.setattr(RandomBf16Weights, "__getitem__", lambda self, name: pytest.fail("float32 copy"))
        np.testing.assert_array_equal(as_bf16(weights, name), bits)
        piece = np.empty(100, np.uint8)
        Bf16Bytes(weights, name).read_into(300, piece)
        np.testing.assert_array_equal(piece, bits.reshape(-1).view(np.uint8)[300:400])
    # Scaled as random_weights scales them: 1/sqrt(fan_in), norm gains near 1, biases 0.5
    assert abs(weights[name].std() * math.sqrt(1000) - 1) < 0.02 and abs(weights[name].mean()) < 0.002
    gains = weights["model.layers.0.input_layernorm.weight"]
    assert abs(gains.mean() - 1) < 0.05 and 0.05 < gains.std() < 0.15
    assert 0.35 < weights["model.layers.0.self_attn.q_proj.bias"].std() < 0.65


def test_random_bf16_weights_in_chunks(monkeypatch):
    """A tensor of several generator chunks (filled by threads) is the same on every call and fully written."""
    monkeypatch.setattr(RandomBf16Weights, "CHUNK", 1000)
    weights = RandomBf16Weights(tiny_config(), seed=1)
    name = "model.embed_tokens.weight"  # 512 x 64: 33 chunks, the last one partial
    bits = weights.stored(name)
    np.testing.assert_array_equal(weights.stored(name), bits)
    values = bf16_to_f32(bits)
    assert np.isfinite(values).all() and abs(values.std() * 8 - 1) < 0.03
    tails = values.reshape(-1)[-1000:], values.reshape(-1)[:1000]
    assert abs(tails[0].std() - tails[1].std()) < 0.02 and not np.array_equal(*tails)


@pytest.mark.parametrize("shards", [1, 3])
def test_random_bf16_checkpoint_is_written_as_made(tmp_path, shards):
    """bench/load_8b.py's checkpoint: RandomBf16Weights saved as bf16 hold exactly the weights the dummy model runs,
    in files any safetensors reader takes."""
    config = tiny_config(architecture="Qwen2ForCausalLM", tie_word_embeddings=True)
    weights = RandomBf16Weights(config, seed=4)
    path = save_hf_model_dir(tmp_path / "m", config, weights, dtype="bfloat16", shards=shards)
    loaded = load_model(path)
    assert loaded.config.torch_dtype == "bfloat16" and set(loaded.weights) == set(weights)
    for name in weights:
        np.testing.assert_array_equal(loaded.weights.stored(name), weights.stored(name), err_msg=name)
    st_torch = pytest.importorskip("safetensors.torch")
    theirs = {}
    for file in path.glob("*.safetensors"):
        theirs |= st_torch.load_file(str(file))
    assert "lm_head.weight" not in theirs and len(theirs) == len(weights) - 1
    name = "model.layers.1.self_attn.v_proj.bias"
    np.testing.assert_array_equal(theirs[name].float().numpy(), weights[name])


def test_bench_refuses_an_unknown_dummy_model_in_one_line():
    from click.testing import CliRunner

    from tinyvllm.cli import main

    result = CliRunner().invoke(main, ["bench", "--dummy-weights", "llama-9b", "--backend", "numpy"])
    assert result.exit_code == 1
    assert "unknown dummy model 'llama-9b': choose from" in result.output and "Traceback" not in result.output


def test_bench_refuses_a_model_that_does_not_fit_in_one_line(monkeypatch):
    from click.testing import CliRunner

    from tinyvllm.backends import numpy_backend
    from tinyvllm.cli import main

    monkeypatch.setattr(numpy_backend, "available_memory", lambda: 1000)
    result = CliRunner().invoke(main, ["bench", "--dummy-weights", "tiny", "--backend", "numpy", "--scale", "0.05"])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert result.output.startswith("Error: the model's weights need") and len(result.output.splitlines()) == 1


FAST_LIMITS = {"bandwidth_bytes_s": 1e10, "gemm_flops": 1e11}


def test_switched_settings_go_through_engine_config_and_are_recorded(monkeypatch):
    """W2 and W5 switch chunked prefill and the prefix cache through the LLM's EngineConfig: what llm.info()
    says while a run goes is what the engine does, each result records its settings, and the LLM's own return."""
    from tinyvllm import benchmark

    llm = LLM(dummy_model("tiny"), backend="numpy", max_num_seqs=8, enable_prefix_caching=False)
    seen, real = [], benchmark.run_workload

    def spy(llm_, requests, *args, **kwargs):
        info, engine = llm_.info(), llm_.llm_engine
        seen.append(((info["enable_prefix_caching"], info["enable_chunked_prefill"]),
                     (engine.block_manager.enable_prefix_caching, engine.scheduler.enable_chunked_prefill)))
        return real(llm_, requests, *args, **kwargs)

    monkeypatch.setattr(benchmark, "run_workload", spy)
    work = run_benchmark(llm, ["W1", "W2", "W5"], scale=0.02, limits=FAST_LIMITS)["workloads"]
    assert len(seen) == 5 and all(recorded == running for recorded, running in seen)
    # the LLM's own setting: the prefix cache is not switched on behind its back
    assert work["W1"]["engine_settings"] == {"enable_chunked_prefill": True, "enable_prefix_caching": False}
    assert work["W2"]["engine_settings"]["enable_chunked_prefill"] is True
    assert work["W2"]["unchunked"]["engine_settings"]["enable_chunked_prefill"] is False
    assert work["W5"]["engine_settings"]["enable_prefix_caching"] is True
    assert work["W5"]["cache_off"]["engine_settings"]["enable_prefix_caching"] is False
    assert not llm.info()["enable_prefix_caching"] and not llm.llm_engine.block_manager.enable_prefix_caching
    with pytest.raises(ValueError, match="max_num_seqs cannot change on a running LLM"):
        with benchmark.engine_settings(llm, max_num_seqs=4):
            pass


def test_bench_llm_takes_the_benchmarks_defaults_under_the_given_settings():
    from tinyvllm.benchmark import BENCH_ENGINE, bench_llm

    llm = bench_llm(None, "tiny", ["W1"], backend="numpy", max_num_batched_tokens=None)
    assert llm.engine_config.max_num_seqs == BENCH_ENGINE["max_num_seqs"] == 512
    assert llm.engine_config.max_num_batched_tokens == 8192  # EngineConfig's own default
    assert llm.engine_config.max_model_len == min(4096, llm.model_config.max_position_embeddings)
    assert bench_llm(None, "tiny", ["W1"], backend="numpy", max_num_seqs=8).engine_config.max_num_seqs == 8
    assert bench_llm(None, "tiny", ["J1"], backend="numpy").tokenizer.vocab_size >= 512  # J1: text tokenizer


def test_bench_command_records_what_ran(tmp_path, monkeypatch):
    import json

    from click.testing import CliRunner

    from tinyvllm.cli import main

    monkeypatch.setattr("tinyvllm.benchmark.measure_limits", lambda backend, fp8=False: FAST_LIMITS)
    out = tmp_path / "b.json"
    result = CliRunner().invoke(main, ["bench", "--dummy-weights", "tiny", "--backend", "numpy", "--workloads", "W3",
                                       "--scale", "0.02", "--no-prefix-caching", "--json", str(out)])
    assert result.exit_code == 0, result.output
    recorded = json.loads(out.read_text())
    assert recorded["llm"]["max_num_seqs"] == 512 and recorded["llm"]["enable_prefix_caching"] is False
    assert recorded["workloads"]["W3"]["engine_settings"]["enable_prefix_caching"] is False


def test_chain_choices_name_each_shapes_form_and_its_timings():
    """bench/batch_invariant.py and profile_step.py print which form each weight shape of a batch-invariant LLM runs
    in (gemv_chain, in 8-row tiles, or cuBLAS: as its Linear holds them) with the step times it was chosen by; a
    backend without the timings says so."""
    from types import SimpleNamespace

    from tinyvllm.benchmark import chain_choices

    linear = SimpleNamespace(chain_shapes={(3072, 2048), (2048, 2048)}, chain8_shapes={(2048, 2048)})
    forward = SimpleNamespace(chain_timings={(3072, 2048): {"cuBLAS": 1.3412, "chain": 1.2681, "chain8": 1.2701},
                                             (2048, 8192): {"cuBLAS": 1.4, "chain": 1.4},
                                             (2048, 2048): {"cuBLAS": 1.5, "chain": 1.6, "chain8": 1.45}},
                              linear=linear)
    llm = SimpleNamespace(backend=SimpleNamespace(forward=forward))
    assert chain_choices(llm) == ("2048x2048 chain8 (step us: cuBLAS 1500.0, chain 1600.0, chain8 1450.0); "
                                  "2048x8192 cuBLAS (step us: cuBLAS 1400.0, chain 1400.0); "
                                  "3072x2048 chain (step us: cuBLAS 1341.2, chain 1268.1, chain8 1270.1)")
    assert chain_choices(SimpleNamespace(backend=SimpleNamespace())).startswith("no gemv_chain timings")


@pytest.mark.parametrize("preset", sorted(p for p, make in PRESETS.items() if not make().num_experts))
def test_the_decode_gemm_shapes_are_the_checkpoint_matrices_the_layers_multiply_by(preset):
    config = PRESETS[preset]()
    layer = {name.split(".")[-2]: shape for name, shape in weight_shapes(config).items()
             if name.startswith("model.layers.0.") and len(shape) == 2}
    rows = {product: sum(layer[part][0] for part in parts) for product, parts in (
        ("qkv", ("q_proj", "k_proj", "v_proj")), ("gate_up", ("gate_proj", "up_proj")))
        if all(part in layer for part in parts)}
    rows.setdefault("qkv", layer.get("qkv_proj", (0,))[0])
    rows.setdefault("gate_up", layer.get("gate_up_proj", (0,))[0])
    shapes = {name: (n, k) for name, (n, k, _, _) in decode_gemm_shapes(config).items()}
    assert shapes == {"qkv": (rows["qkv"], config.hidden_size), "o": layer["o_proj"],
                      "gate_up": (rows["gate_up"], config.hidden_size), "down": layer["down_proj"],
                      "lm_head": weight_shapes(config)["lm_head.weight"]}
    # O and down add into the float32 residual stream; QKV and gate/up write bf16; the logits are float32
    assert {name: flags for name, (_, _, *flags) in decode_gemm_shapes(config).items()} == {
        "qkv": [False, False], "o": [True, True], "gate_up": [False, False], "down": [True, True],
        "lm_head": [True, False]}
