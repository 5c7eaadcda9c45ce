"""FP8 W8A8 end to end on the GPU: a random model with quantization="fp8" on the cuda backend against the numpy
backend with quantization="fp8" (its twin), and next to the same model in bf16; through the engine with CUDA
graphs (graph replay = eager). Lines starting with REPORT carry measured numbers (pytest -s).

Both backends quantize the same weights to the same codes (bf16-exact values, one IEEE division per row), but the
GPU quantizes activations held in bf16 and the numpy backend float32 ones: a value within a bf16 step of an e4m3
rounding boundary lands one e4m3 step (6-12%) apart, and in a random model those few flips spread. The numpy twin
itself moves as much when its linear layers' inputs are rounded to bf16 first (measured on the CPU: 9-11% of the
logits' norm; W8A8 against float32: 13-15%), so the model-level bounds are set by that measured sensitivity; the
kernels are held to their twins exactly or to float32 rounding in test_fp8_kernels.py.
"""

from dataclasses import replace

import numpy as np
import pytest

from test_cuda_model import (CONFIGS, bf16_model, decode_against_numpy, gpu_logits, make_seqs, prefill_batch,
                             rel_err)
from tinyvllm import LLM, SamplingParams
from tinyvllm.backends.cuda.tensors import E4M3
from tinyvllm.backends.numpy_backend import NumpyBackend
from tinyvllm.config import EngineConfig
from tinyvllm.engine.block_manager import BlockManager
from tinyvllm.model.dtypes import bf16_to_f32, f32_to_bf16

pytestmark = pytest.mark.gpu


def prefill_and_decode(cuda, ours, ref, config):
    """Three prompts prefilled together, then 6 decode steps fed the numpy backend's greedy tokens: (each step's
    logits rel error, each step's greedy agreement, cuda's prefill logits)."""
    rng = np.random.default_rng(0)
    seqs = make_seqs([rng.integers(0, config.vocab_size, n) for n in (5, 90, 40)])
    bm = BlockManager(EngineConfig(block_size=16, enable_prefix_caching=False), 64)
    step = prefill_batch(seqs, bm, 16)
    sampled, want = ours.execute(step).last_token_ids, ref.forward(step, step.query_start_loc[1:] - 1)
    prefill_logits = gpu_logits(cuda, ours, len(seqs))
    decode_errors, decode_agree, _ = decode_against_numpy(cuda, ours, ref, seqs, want.argmax(-1), bm)
    return ([rel_err(prefill_logits, want), *decode_errors], [np.mean(sampled == want.argmax(-1)), *decode_agree],
            prefill_logits)


def numpy_prefill_logits(model, limits, monkeypatch, bf16_inputs: bool):
    """The numpy backend's logits at every prefill position of prefill_and_decode's prompts; bf16_inputs: each
    linear layer's input rounded to bf16 before it is quantized (as the GPU holds it)."""
    import tinyvllm.backends.host_weight as host_weight

    quantize = host_weight.quantize_activations
    if bf16_inputs:
        monkeypatch.setattr(host_weight, "quantize_activations",
                            lambda x, *args: quantize(bf16_to_f32(f32_to_bf16(np.asarray(x, np.float32))), *args))
    backend = NumpyBackend(model, limits)
    backend.init_kv_cache()
    rng = np.random.default_rng(0)
    seqs = make_seqs([rng.integers(0, model.config.vocab_size, n) for n in (5, 90, 40)])
    step = prefill_batch(seqs, BlockManager(EngineConfig(block_size=16, enable_prefix_caching=False), 64), 16)
    logits = backend.forward(step, np.arange(step.query_start_loc[-1]))
    monkeypatch.setattr(host_weight, "quantize_activations", quantize)
    return logits, step.query_start_loc[1:] - 1


@pytest.mark.parametrize("name,layers", [("llama-3.2-1b", 2), ("smollm2-135m", 4)])
def test_cuda_fp8_against_numpy_fp8_and_bf16(cuda, cuda_backend, monkeypatch, name, layers):
    """cuda W8A8 follows the numpy twin within twice the twin's own sensitivity to bf16 inputs, and moves away
    from cuda bf16 about as far as the twin moves from float32 (so it quantizes, and only as the scheme does)."""
    config = replace(CONFIGS[name](), num_hidden_layers=layers)
    model = bf16_model(config)
    limits = EngineConfig(block_size=16, max_num_seqs=4, max_num_batched_tokens=128, max_model_len=512,
                          num_kv_blocks=64, quantization="fp8")
    ours, ref = cuda_backend(model, limits), NumpyBackend(model, limits)
    assert all(getattr(layer, f).dtype == E4M3 for layer in ours.forward.layers for f in ("qkv", "o", "gate_up",
                                                                                            "down"))
    ours.init_kv_cache()
    ref.init_kv_cache()
    errors, agree, fp8_logits = prefill_and_decode(cuda, ours, ref, config)
    ours.close()
    bf16_limits = replace(limits, quantization=None)
    bf16, ref32 = cuda_backend(model, bf16_limits), NumpyBackend(model, bf16_limits)
    bf16.init_kv_cache()
    ref32.init_kv_cache()
    bf16_errors, bf16_agree, bf16_logits = prefill_and_decode(cuda, bf16, ref32, config)
    bf16.close()
    twin, last = numpy_prefill_logits(model, limits, monkeypatch, False)
    sensitivity = rel_err(numpy_prefill_logits(model, limits, monkeypatch, True)[0], twin)
    numpy_effect = rel_err(twin[last], numpy_prefill_logits(model, bf16_limits, monkeypatch, False)[0][last])
    cuda_effect = rel_err(fp8_logits, bf16_logits)
    print(f"REPORT fp8 W8A8 cuda vs numpy fp8 {name} ({layers} layers): logits rel err prefill {errors[0]:.2e}, "
          f"decode mean {np.mean(errors[1:]):.2e} max {max(errors[1:]):.2e}; greedy agree {np.mean(agree):.3f} | "
          f"the twin's own change with bf16 inputs {sensitivity:.2e} | bf16 cuda vs numpy float32: prefill "
          f"{bf16_errors[0]:.2e}, decode max {max(bf16_errors[1:]):.2e}, agree {np.mean(bf16_agree):.3f} | fp8 vs "
          f"bf16 logits: cuda {cuda_effect:.2e}, numpy {numpy_effect:.2e}")
    assert np.mean(errors) < 2 * sensitivity + 0.02
    assert 0.5 * numpy_effect < cuda_effect < 2 * numpy_effect + 0.05


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tinyvllm.model.dummy import random_weights, save_hf_model_dir, smollm2_135m_config

    config = replace(smollm2_135m_config(), num_hidden_layers=4)
    return save_hf_model_dir(tmp_path_factory.mktemp("fp8"), config, random_weights(config, 3), dtype="bfloat16")


PROMPTS = [[1, 2, 3, 4], [5, 6, 7], list(range(10, 90)), [300] * 5]
GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
SETTINGS = dict(max_num_seqs=8, max_model_len=256, num_kv_blocks=128)


def generate(model_dir, **settings):
    with LLM(model_dir, **{**SETTINGS, **settings}) as llm:
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


def common_prefix(a, b) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def test_fp8_through_the_engine_with_cuda_graphs(model_dir):
    """LLM(quantization="fp8") on cuda: decode steps replayed from CUDA graphs give the eager steps' greedy tokens
    (4 sequences: the gemv_fp8 path at decode, cuBLASLt's FP8 GEMM in the prefill); the completions are reported
    against the numpy backend's fp8 ones and cuda bf16's."""
    graphs = generate(model_dir, backend="cuda", quantization="fp8", cuda_graph_capture="eager")
    eager = generate(model_dir, backend="cuda", quantization="fp8", enforce_eager=True)
    assert graphs == eager and all(len(tokens) == GREEDY.max_tokens for tokens in graphs)
    numpy = generate(model_dir, backend="numpy", quantization="fp8")
    bf16 = generate(model_dir, backend="cuda")
    total = sum(map(len, numpy))
    print(f"REPORT fp8 engine: greedy tokens before the first divergence, cuda fp8 vs numpy fp8 "
          f"{sum(map(common_prefix, graphs, numpy))}/{total}, cuda fp8 vs cuda bf16 "
          f"{sum(map(common_prefix, graphs, bf16))}/{total}")


def test_fp8_lm_head_through_the_engine(model_dir):
    """quantize_lm_head on cuda (a tied LM head: codes of its own, the bf16 embedding kept for the lookup): prompt
    logprobs (92 prompt rows through the LM head at once: cuBLASLt's FP8 GEMM written into the logits and scaled
    there) and decode logprobs (gemv_fp8) follow the numpy twin with the same setting as closely as the layers
    alone do, and move away from quantization="fp8" alone about as far as the twin moves."""
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, prompt_logprobs=0, logprobs=0)

    def run(backend, **settings):
        with LLM(model_dir, backend=backend, quantization="fp8", **SETTINGS, **settings) as llm:
            if settings and backend == "cuda":
                forward = llm.llm_engine.backend.forward
                assert forward.lm_head.dtype == E4M3 and forward.embed.dtype != E4M3
            outs = llm.generate(PROMPTS, params)
        prompt = [[d[t].logprob for d, t in zip(o.prompt_logprobs[1:], p[1:])] for o, p in zip(outs, PROMPTS)]
        decode = [[d[t].logprob for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outs]
        return np.concatenate(prompt), [o.outputs[0].token_ids for o in outs], np.concatenate(decode)

    cuda_head, cuda_tokens, cuda_decode = run("cuda", quantize_lm_head=True)
    numpy_head, numpy_tokens, numpy_decode = run("numpy", quantize_lm_head=True)
    cuda_layers, _, _ = run("cuda")
    numpy_layers, _, _ = run("numpy")
    gap, layers_gap = np.abs(cuda_head - numpy_head).mean(), np.abs(cuda_layers - numpy_layers).mean()
    cuda_effect, numpy_effect = np.abs(cuda_head - cuda_layers).mean(), np.abs(numpy_head - numpy_layers).mean()
    same = [a == b for a, b in zip(cuda_tokens, numpy_tokens)]
    decode_gap = np.mean([np.abs(np.subtract(c, n)).mean() for c, n, s in zip(
        np.split(cuda_decode, 4), np.split(numpy_decode, 4), same) if s] or [0.0])
    print(f"REPORT fp8 LM head: prompt logprob |cuda - numpy| {gap:.3e} (layers alone {layers_gap:.3e}); the LM "
          f"head's own effect cuda {cuda_effect:.3e}, numpy {numpy_effect:.3e}; decode logprob gap {decode_gap:.3e} "
          f"over {sum(same)} of 4 identical completions")
    assert gap < 2 * layers_gap + 0.02
    assert 0.5 * numpy_effect < cuda_effect < 2 * numpy_effect + 0.05 and numpy_effect > 1e-4


@pytest.mark.parametrize("scheme", ["ct-channel", "fp8-tensor", "fp8-block"])
def test_an_fp8_checkpoint_on_cuda_follows_the_numpy_backend(tmp_path, scheme):
    """An FP8 checkpoint (ct-channel: layer 1's down projection left unquantized, after an e4m3 gate/up) on cuda
    against the numpy backend on the same file (its codes as stored, block scales too), teacher-forced: within twice
    the distance W8A8 itself puts between the two backends (quantization="fp8" on the dequantized weights) plus
    0.02."""
    import sys
    from pathlib import Path

    pytest.importorskip("torch")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from test_fp8_checkpoints import write_fp8_checkpoint
    from test_fp8_weights import our_logprobs
    from tinyvllm.model.dummy import save_hf_model_dir

    config = dict(architecture="Qwen3ForCausalLM", num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                  hidden_size=256, head_dim=64, intermediate_size=128)
    path, cfg, weights, *_ = write_fp8_checkpoint(tmp_path / "fp8", scheme, **config)
    dequantized = save_hf_model_dir(tmp_path / "dequantized", cfg, weights)
    prompts = [np.random.default_rng(i).integers(3, 500, 30).tolist() for i in range(3)]

    def logprobs(source, backend, **settings):
        with LLM(str(source), backend=backend, max_model_len=128, **settings) as llm:
            if backend == "cuda" and source == path:  # block scales run as stored, with their block-scaled kernels
                assert llm.llm_engine.backend.forward.block_codes == (scheme == "fp8-block")
            return our_logprobs(llm, prompts)

    apart = np.abs(logprobs(path, "cuda") - logprobs(path, "numpy")).mean()
    noise = np.abs(logprobs(dequantized, "cuda", quantization="fp8")
                   - logprobs(dequantized, "numpy", quantization="fp8")).mean()
    print(f"REPORT fp8 checkpoint {scheme}: cuda vs numpy mean |logprob diff| {apart:.4f}; W8A8's own between the "
          f"backends {noise:.4f}")
    assert apart < 2 * noise + 0.02, (apart, noise)
