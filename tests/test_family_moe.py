"""The mixture-of-experts families (Mixtral, Qwen3-MoE, OLMoE) on the numpy backend against HF transformers (torch
CPU, float32, eager attention), loaded by both from the same HF model dir; their config and checkpoint names; FP8
experts (numpy W8A8 against a torch fake-quant model; what each backend takes). The cuda backend's MoE kernels:
tests/gpu/test_moe_kernels.py, test_moe_models.py; an FP8 checkpoint's experts there: test_moe_cuda_host.py."""

import json
import types
from dataclasses import replace

import numpy as np
import pytest
from helpers import llm_for, require, run, one_line_error

from tinyvllm import LLM, SamplingParams
from tinyvllm.model.config import ModelConfig
from tinyvllm.model.dummy import random_weights, save_hf_model_dir, tiny_config
from tinyvllm.model.loader import load_model

torch = require("torch")
transformers = require("transformers")

MOE = dict(num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16, hidden_size=64)
CONFIGS = {
    # Mixtral: renormalized top-2 of 4; head_dim from hidden / heads
    "mixtral": dict(MOE, architecture="MixtralForCausalLM", num_experts=4, num_experts_per_tok=2,
                    intermediate_size=48, moe_intermediate_size=48),
    # Qwen3-MoE: q/k norms per head, its own expert width, a dense layer (mlp_only_layers), norm_topk_prob
    "qwen3_moe": dict(MOE, architecture="Qwen3MoeForCausalLM", num_experts=8, num_experts_per_tok=3,
                      norm_topk_prob=True, intermediate_size=96, moe_intermediate_size=32, mlp_only_layers=(1,),
                      rope_theta=1e6, tie_word_embeddings=True),
    # Qwen3-MoE: decoder_sparse_step 2 (layers 1 and 3 sparse), unnormalized top-k
    "qwen3_moe-step2": dict(MOE, architecture="Qwen3MoeForCausalLM", num_hidden_layers=4, num_experts=6,
                            num_experts_per_tok=2, norm_topk_prob=False, intermediate_size=80,
                            moe_intermediate_size=24, decoder_sparse_step=2),
    # OLMoE: unnormalized top-8 of 16, q/k norms over the whole projection
    "olmoe": dict(MOE, architecture="OlmoeForCausalLM", num_experts=16, num_experts_per_tok=8,
                  intermediate_size=32, moe_intermediate_size=32),
}
PROMPTS = [[5, 77, 300, 12, 9, 411, 38], [100, 3, 3, 250, 8, 19, 460, 61, 7, 222, 14], [42]]


def model_dir(tmp_path, name):
    config = tiny_config(**CONFIGS[name])
    return save_hf_model_dir(tmp_path / name, config, random_weights(config, seed=len(name)))


def hf_model(path):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info  # our checkpoint names are HF's
    return model.eval()


def hf_prompt_logprobs(model, ids):
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].double()
    return torch.log_softmax(logits, -1)[torch.arange(len(ids) - 1), torch.tensor(ids[1:], dtype=torch.long)].numpy()


def hf_greedy(model, ids, n):
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, min_new_tokens=n)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_numpy_matches_hf(tmp_path, name):
    path = model_dir(tmp_path, name)
    model = hf_model(path)
    llm = llm_for(path, block_size=4)
    params = SamplingParams(max_tokens=8, temperature=0, prompt_logprobs=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": ids} for ids in PROMPTS], params)
    worst = 0.0
    for ids, out in zip(PROMPTS, outs):
        ours = np.array([entry[token] for token, entry in zip(ids[1:], out.prompt_logprobs[1:])])
        ours = np.array([v.logprob for v in ours])
        worst = max(worst, float(np.abs(ours - hf_prompt_logprobs(model, ids)).max(initial=0.0)))
        assert out.outputs[0].token_ids == hf_greedy(model, ids, 8)
    assert worst <= 1e-4


@pytest.mark.parametrize("name", list(CONFIGS))
def test_config_round_trip(tmp_path, name):
    path = model_dir(tmp_path, name)
    config = load_model(path).config
    assert config == ModelConfig.from_dir(path)
    want = tiny_config(**CONFIGS[name])
    for field in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step",
                  "mlp_only_layers"):
        assert getattr(config, field) == getattr(want, field)
    # HF reads the same MoE config from the file (Mixtral's count under its own key)
    hf = transformers.AutoConfig.from_pretrained(str(path))
    assert getattr(hf, "num_local_experts", getattr(hf, "num_experts", None)) == want.num_experts
    sparse = [i for i in range(config.num_hidden_layers) if config.moe_layer(i)]
    assert sparse == {"qwen3_moe": [0, 2], "qwen3_moe-step2": [1, 3]}.get(name, [0, 1, 2])


def test_mixtral_always_renormalizes_and_reads_its_expert_count():
    d = tiny_config(**CONFIGS["mixtral"]).to_hf_dict()
    assert d["num_local_experts"] == 4 and "num_experts" not in d
    d["norm_topk_prob"] = False  # HF's Mixtral renormalizes whatever the config says
    assert ModelConfig.from_hf_dict(d).norm_topk_prob is True
    d = tiny_config(**CONFIGS["olmoe"]).to_hf_dict()
    del d["norm_topk_prob"]
    assert ModelConfig.from_hf_dict(d).norm_topk_prob is False  # OLMoE's default: the probabilities as they are


@pytest.mark.parametrize("change, message", [
    ({"num_experts_per_tok": 9}, "num_experts_per_tok=9"),
    ({"num_experts_per_tok": 0}, "num_experts_per_tok=0"),
    ({"num_experts": 0}, "num_experts=0"),
    ({"mlp_only_layers": [7]}, "mlp_only_layers entry 7"),
    ({"mlp_only_layers": 1}, "mlp_only_layers=1"),
    ({"clip_qkv": 8.0}, "clip_qkv=8.0"),
])
def test_bad_moe_configs_are_refused(change, message):
    d = tiny_config(**CONFIGS["qwen3_moe"]).to_hf_dict() | change
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf_dict(d)


def test_dense_family_with_experts_is_refused():
    with pytest.raises(ValueError, match="LlamaForCausalLM has no experts"):
        replace(tiny_config(), num_experts=4, num_experts_per_tok=2)


def test_a_missing_expert_is_named(tmp_path):
    path = model_dir(tmp_path, "mixtral")
    from tinyvllm.model.loader import read_safetensors, write_safetensors

    tensors = read_safetensors(path / "model.safetensors")
    del tensors["model.layers.1.block_sparse_moe.experts.3.w2.weight"]
    write_safetensors(path / "model.safetensors", tensors)
    with pytest.raises(ValueError, match=r"tensor model.layers.1.block_sparse_moe.experts.3.w2.weight is missing"):
        load_model(path)


def test_weight_bytes_are_what_the_numpy_backend_holds(tmp_path):
    from tinyvllm.backends import numpy_backend

    path = model_dir(tmp_path, "qwen3_moe")  # tied, a dense layer and expert layers
    llm = llm_for(path)
    backend = llm.llm_engine.backend
    arrays = [backend.embed, backend.final_norm, backend.lm_head.data] + [
        getattr(w, "data", w) for layer in backend.layers for w in vars(layer).values() if w is not None]
    held = sum(a.nbytes for a in arrays)  # the tied LM head: the embedding's transpose, a copy
    assert numpy_backend.host_weight_bytes(backend.config) == held


def test_a_model_that_does_not_fit_is_one_line(tmp_path, monkeypatch):
    from tinyvllm.backends import numpy_backend

    path = model_dir(tmp_path, "mixtral")
    need = numpy_backend.host_weight_bytes(load_model(path).config)
    monkeypatch.setattr(numpy_backend, "available_memory", lambda: need - 1)
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"prompt": "hi"}) + "\n")
    line = one_line_error(run(path, src, tmp_path / "out.parquet"), exit_code=None)
    assert "weights need" in line and "GiB as float32" in line


def test_kv_cache_fits_in_the_memory_the_weights_leave(tmp_path, monkeypatch):
    from tinyvllm.backends import numpy_backend

    path = model_dir(tmp_path, "olmoe")
    llm = llm_for(path, num_kv_blocks=None, cpu_kv_cache_gib=64.0)
    backend = llm.llm_engine.backend
    block = backend.kv_bytes_per_block()
    monkeypatch.setattr(numpy_backend, "available_memory", lambda: int(10.5 * block / numpy_backend.KV_SHARE))
    assert backend.init_kv_cache() == 10
    monkeypatch.setattr(numpy_backend, "available_memory", lambda: block // 2)
    with pytest.raises(MemoryError, match="no room for a KV cache on the numpy backend"):
        backend.init_kv_cache()
    monkeypatch.setattr(numpy_backend, "available_memory", lambda: None)  # unknown: the setting alone
    assert backend.init_kv_cache() == min(8 * -(-2048 // 16), (64 << 30) // block)


def stacked_for_gguf(config, weights):
    """The weights as convert_hf_to_gguf hands them over: each layer's experts stacked per part, under the merged
    name gguf's tensor map knows (mlp.experts.gate_proj, block_sparse_moe.experts.w1, ...)."""
    out = {}
    for name, w in weights.items():
        head, sep, rest = name.partition(".experts.")
        if not sep:
            out[name] = w
            continue
        merged = head + ".experts." + rest.partition(".")[2]
        if merged not in out:
            out[merged] = np.stack([weights[f"{head}.experts.{e}.{rest.partition('.')[2]}"]
                                    for e in range(config.num_experts)])
    return out


# a qwen3moe GGUF has no dense layers (llama.cpp makes every layer sparse); Mixtral's is a "llama" file with experts
@pytest.mark.parametrize("name, arch, change", [("mixtral", "llama", {}),
                                                ("qwen3_moe", "qwen3moe", {"mlp_only_layers": ()})])
def test_gguf_with_expert_tensors_runs_as_the_hf_dir(tmp_path, name, arch, change):
    from test_gguf import write_gguf

    config = replace(tiny_config(**CONFIGS[name]), tie_word_embeddings=False, **change)
    weights = random_weights(config, seed=3)
    hf_dir = save_hf_model_dir(tmp_path / "hf", config, weights)

    def experts(w):
        w.add_expert_count(config.num_experts)
        w.add_expert_used_count(config.num_experts_per_tok)
        w.add_expert_feed_forward_length(config.moe_intermediate_size)

    path = write_gguf(tmp_path / "m.gguf", config, stacked_for_gguf(config, weights), arch=arch, metadata=experts)
    loaded = load_model(path)
    assert loaded.config.architecture == config.architecture and loaded.config.num_experts == config.num_experts
    for hf_name in ("model.layers.1.mlp.experts.5.down_proj.weight",
                    "model.layers.1.block_sparse_moe.experts.3.w3.weight"):
        if hf_name in weights:
            np.testing.assert_array_equal(loaded.weights[hf_name], weights[hf_name])
    params = SamplingParams(max_tokens=6, temperature=0, prompt_logprobs=0, ignore_eos=True)
    prompts = [{"prompt_token_ids": ids} for ids in PROMPTS]
    for quantization in (None, "fp8"):  # fp8: the GGUF's experts dequantized at load, then quantized as the dir's
        llms = [llm_for(p, quantization=quantization) for p in (path, hf_dir)]
        assert {layer.experts_down.dtype for layer in llms[0].backend.layers if layer.experts_down is not None} == \
            {"float8_e4m3fn" if quantization else "float32"}
        ours, ref = (llm.generate(prompts, params) for llm in llms)
        for a, b in zip(ours, ref):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
            got = [v.logprob for e in a.prompt_logprobs[1:] for v in e.values()]
            want = [v.logprob for e in b.prompt_logprobs[1:] for v in e.values()]
            assert np.allclose(got, want, atol=1e-5)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_cuda_backend_takes_moe_models(name):
    """Nothing in a MoE family is beyond the cuda backend's kernels (cuda/moe.cu; OLMoE's whole-projection q/k norms:
    qk_norm_projection), so --backend auto runs them on a usable GPU."""
    from tinyvllm.backends import cuda_refusal

    assert cuda_refusal(tiny_config(**CONFIGS[name]), None) is None


def fake_quantize_experts(model, quantize_weights=True, group=None, input_scale=None):
    """Each expert layer of HF's model run as W8A8 with the ideal quantizers (test_fp8_weights.py): every expert's
    gate/up and down rows through e4m3 with a scale per expert and row (unless not quantize_weights: an FP8
    checkpoint's, already dequantized), each expert's input through e4m3 per token (per token and `group` columns,
    or with the static input_scale); routers untouched (not nn.Linear, so fake_quantize leaves them too)."""
    from test_fp8_weights import fq_rows, fq_tokens

    def fq(x):
        return fq_tokens(x, group, input_scale)

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for e in range(self.num_experts):
            token_idx, slot = torch.where(top_k_index == e)
            if len(token_idx):
                gate, up = torch.nn.functional.linear(fq(hidden_states[token_idx]),
                                                      self.gate_up_proj[e]).chunk(2, dim=-1)
                h = torch.nn.functional.linear(fq(self.act_fn(gate) * up), self.down_proj[e])
                out.index_add_(0, token_idx, h * top_k_weights[token_idx, slot, None])
        return out

    for layer in model.model.layers:
        experts = getattr(layer.mlp, "experts", None)
        if experts is not None:
            if quantize_weights:
                with torch.no_grad():
                    experts.gate_up_proj.data = torch.stack([fq_rows(w) for w in experts.gate_up_proj.data])
                    experts.down_proj.data = torch.stack([fq_rows(w) for w in experts.down_proj.data])
            experts.forward = types.MethodType(forward, experts)
    return model


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe", "olmoe"])
def test_numpy_w8a8_experts_equal_a_torch_fake_quant_model(tmp_path, name):
    """quantization="fp8" on the numpy backend quantizes the experts too (per expert and output channel, their inputs
    per token; the router stays float32): teacher-forced logprobs are HF's model with every decoder linear layer
    and expert fake-quantized, to well within the quantization's own error (float32 summation order can move an
    activation across an e4m3 rounding boundary, as test_fp8_weights.py says)."""
    from test_fp8_weights import fake_quantize

    path = model_dir(tmp_path, name)
    llm = LLM(str(path), backend="numpy", quantization="fp8", max_model_len=128)
    experts = [layer.experts_gate_up for layer in llm.backend.layers if layer.experts_gate_up is not None]
    assert experts and all(w.dtype == "float8_e4m3fn" for w in experts)
    prompts = [np.random.default_rng(i).integers(3, 500, 30).tolist() for i in range(3)]
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    ours = np.concatenate([[d[t].logprob for d, t in zip(o.prompt_logprobs[1:], p[1:])]
                           for o, p in zip(outs, prompts)])
    reference = np.concatenate([hf_prompt_logprobs(fake_quantize_experts(fake_quantize(hf_model(path))), p)
                                for p in prompts])
    unquantized = np.concatenate([hf_prompt_logprobs(hf_model(path), p) for p in prompts])
    error, quantization = np.abs(ours - reference).mean(), np.abs(unquantized - reference).mean()
    assert error < quantization / 5, (error, quantization)
    assert quantization > 1e-3


# an FP8 checkpoint's scheme (test_fp8_checkpoints.SCHEMES) -> the config changes it needs: 128 x 128 blocks need
# widths of whole blocks (each expert's gate and up a multiple of 128 rows, as vLLM requires too)
FP8_MOE_SCHEMES = {"fp8-tensor": {}, "fp8-static": {}, "ct-channel": {}, "ct-static": {},
                   "fp8-block": dict(hidden_size=256, head_dim=64, intermediate_size=128, moe_intermediate_size=128)}


@pytest.mark.parametrize("scheme", list(FP8_MOE_SCHEMES))
@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe", "olmoe"])
def test_an_fp8_checkpoint_of_a_moe_model_runs_as_a_torch_fake_quant_of_its_codes(tmp_path, name, scheme):
    """Every expert's gate, up and down stored in e4m3 with scales of their own (the router unquantized) run as
    stored: the codes are the file's, and teacher-forced logprobs are HF's model of the dequantized weights with
    every linear layer's and expert's input fake-quantized as the scheme says, to well within the quantization's
    own error."""
    from test_fp8_checkpoints import SCHEMES, write_fp8_checkpoint
    from test_fp8_weights import fake_quantize

    path, cfg, weights, input_scale, group = write_fp8_checkpoint(
        tmp_path / "fp8", scheme, **{**CONFIGS[name], **FP8_MOE_SCHEMES[scheme]})
    llm = LLM(str(path), backend="numpy", max_model_len=128)
    layer = next(layer for layer in llm.backend.layers if layer.experts_gate_up is not None)
    assert layer.experts_down.dtype == "float8_e4m3fn" and layer.router.dtype == "float32"
    stored = safetensors_file(path)
    down = "block_sparse_moe.experts.1.w2" if name == "mixtral" else "mlp.experts.1.down_proj"
    codes = stored[f"model.layers.0.{down}.weight"].view(torch.uint8).numpy()
    np.testing.assert_array_equal(layer.experts_down.data[1].T, codes)  # as stored
    prompts = [np.random.default_rng(i).integers(3, 500, 30).tolist() for i in range(3)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=1, prompt_logprobs=0),
                        use_tqdm=False)
    ours = np.concatenate([[d[t].logprob for d, t in zip(o.prompt_logprobs[1:], p[1:])]
                           for o, p in zip(outs, prompts)])
    dequantized = hf_model(save_hf_model_dir(tmp_path / "dequantized", cfg, weights))
    linears = fake_quantize(dequantized, weight_of=lambda n: torch.from_numpy(weights[n]), group=group,
                            input_scale=None if input_scale is None else lambda _: input_scale,
                            skip=SCHEMES[scheme][0].get("ignore", ()))
    reference_model = fake_quantize_experts(linears, quantize_weights=False, group=group, input_scale=input_scale)
    reference = np.concatenate([hf_prompt_logprobs(reference_model, p) for p in prompts])
    unquantized = hf_model(save_hf_model_dir(tmp_path / "float", cfg, random_weights(cfg, 6)))  # the file's seed
    unquantized = np.concatenate([hf_prompt_logprobs(unquantized, p) for p in prompts])
    error, quantization = np.abs(ours - reference).mean(), np.abs(unquantized - reference).mean()
    assert error < quantization / 5, (error, quantization)


def safetensors_file(path):
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def test_an_fp8_checkpoint_with_a_float8_router_is_refused_in_one_line(tmp_path):
    from test_fp8_checkpoints import write_fp8_checkpoint
    from safetensors.torch import save_file

    path, *_ = write_fp8_checkpoint(tmp_path, "fp8-tensor", **CONFIGS["olmoe"])
    tensors = safetensors_file(path)
    router = "model.layers.2.mlp.gate.weight"
    tensors[router] = tensors[router].to(torch.float8_e4m3fn)
    tensors["model.layers.2.mlp.gate.weight_scale"] = torch.ones(1)
    save_file(tensors, str(path / "model.safetensors"))
    message = f"the router {router} is float8: tinyvllm runs routers unquantized, as vLLM does"
    with pytest.raises(ValueError, match=message):
        load_model(path)
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt": "hi"}\n')
    one_line_error(run(path, src, tmp_path / "out.parquet"), message)


def test_an_fp8_checkpoint_with_one_expert_left_float_is_refused_in_one_line(tmp_path):
    """A layer's experts are one stacked tensor: all float8 or none (vLLM's fused MoE takes them so too)."""
    from test_fp8_checkpoints import write_fp8_checkpoint
    from safetensors.torch import save_file

    path, *_ = write_fp8_checkpoint(tmp_path, "fp8-tensor", **CONFIGS["olmoe"])
    tensors = safetensors_file(path)
    up = "model.layers.0.mlp.experts.3.up_proj.weight"
    tensors[up] = tensors[up].float() * tensors.pop(up.removesuffix("weight") + "weight_scale")
    save_file(tensors, str(path / "model.safetensors"))
    message = ("model.layers.0.mlp.experts.0.gate_proj.weight and the tensors packed with it: the parts of a fused "
               "projection (q/k/v, gate/up) and a layer's experts must all be float8")
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt": "hi"}\n')
    one_line_error(run(path, src, tmp_path / "out.parquet"), message)


def test_block_scaled_experts_not_on_whole_blocks_are_refused_in_one_line(tmp_path):
    """An expert's gate and up rows stacked must each be whole 128-row blocks of scales (vLLM requires it too)."""
    from test_fp8_checkpoints import write_fp8_checkpoint

    path, *_ = write_fp8_checkpoint(tmp_path / "model", "fp8-block", **{**CONFIGS["olmoe"],
                                                                      **FP8_MOE_SCHEMES["fp8-block"],
                                                                      "moe_intermediate_size": 64})
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt": "hi"}\n')
    one_line_error(run(path, src, tmp_path / "out.parquet"),
                   "experts.0.gate_proj.weight and the tensors packed with it: a fused projection's parts must have "
                   "a multiple of the weight block's 128 rows")


def test_an_fp8_checkpoint_of_a_moe_model_runs_a_job_from_the_cli(tmp_path):
    import pyarrow.parquet as pq
    from test_fp8_checkpoints import write_fp8_checkpoint

    path, *_ = write_fp8_checkpoint(tmp_path / "model", "fp8-block", **{**CONFIGS["qwen3_moe"],
                                                                      **FP8_MOE_SCHEMES["fp8-block"]})
    src, out = tmp_path / "in.jsonl", tmp_path / "out.parquet"
    src.write_text("".join(json.dumps({"prompt": f"row {i} of a job"}) + "\n" for i in range(3)))
    result = run(path, src, out, "--max-tokens", 4, "--temperature", 0)
    assert result.exit_code == 0, result.output
    table = pq.read_table(out).to_pydict()
    assert table["error"] == [None] * 3 and table["completion_tokens"] == [4] * 3
