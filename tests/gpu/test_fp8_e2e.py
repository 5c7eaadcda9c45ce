"""FP8 W8A8 end to end on the GPU: a random model with quantization="fp8" on the cuda backend against the numpy
backend with quantization="fp8" (its twin), and next to the same model in bf16; through the engine with CUDA
graphs (graph replay = eager). Lines starting with REPORT carry measured numbers (pytest -s).

Both backends quantize the same weights to the same codes (bf16-exact values, one IEEE division per row); the
activations are quantized from bf16 (GPU) or float32 (numpy) values, so an activation code now and then lands one
e4m3 step apart: the logits agree less closely than bf16's 2e-2.
"""

from dataclasses import replace

import numpy as np
import pytest

from agreement import agreed_tokens
from test_cuda_model import (CONFIGS, bf16_model, decode_against_numpy, gpu_logits, make_seqs, prefill_batch,
                             rel_err)
from tinyvllm import LLM, SamplingParams
from tinyvllm.backends.cuda.tensors import E4M3
from tinyvllm.backends.numpy_backend import NumpyBackend
from tinyvllm.config import EngineConfig
from tinyvllm.engine.block_manager import BlockManager

pytestmark = pytest.mark.gpu


def prefill_and_decode(cuda, ours, ref, config):
    """A prefill of three prompts (7, 100 and 33 tokens), then 6 decode steps
    fed the numpy backend's greedy tokens: (logits rel errors, greedy agreements, cuda's prefill logits)."""
    rng = np.random.default_rng(0)
    seqs = make_seqs([rng.integers(0, config.vocab_size, n) for n in (7, 100, 33)])
    bm = BlockManager(EngineConfig(block_size=16, enable_prefix_caching=False), 64)
    batch = prefill_batch(seqs, bm, 16)
    got = ours.execute(batch)
    ref_logits = ref.forward(batch, batch.query_start_loc[1:] - 1)
    logits = gpu_logits(cuda, ours, 3)
    errors, agree = [rel_err(logits, ref_logits)], [np.mean(got.last_token_ids == ref_logits.argmax(-1))]
    decode_errors, decode_agree, _ = decode_against_numpy(cuda, ours, ref, seqs, ref_logits.argmax(-1), bm)
    return errors + decode_errors, agree + decode_agree, logits


@pytest.mark.parametrize("name,layers", [("llama-3.2-1b", 2), ("smollm2-135m", 4)])
def test_cuda_fp8_matches_numpy_fp8(cuda, cuda_backend, name, layers):
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
    print(f"REPORT fp8 W8A8 cuda vs numpy fp8 {name} ({layers} layers): logits rel err prefill {errors[0]:.2e}, "
          f"decode max {max(errors[1:]):.2e}; greedy agree {np.mean(agree):.3f} | bf16 cuda vs numpy float32: "
          f"prefill {bf16_errors[0]:.2e}, decode max {max(bf16_errors[1:]):.2e}, agree {np.mean(bf16_agree):.3f} | "
          f"fp8 vs bf16 cuda prefill logits rel diff {rel_err(fp8_logits, bf16_logits):.2e}")
    assert max(errors) < 0.1 and np.mean(agree) > 0.7


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tinyvllm.model.dummy import random_weights, save_hf_model_dir, smollm2_135m_config

    config = replace(smollm2_135m_config(), num_hidden_layers=4)
    return save_hf_model_dir(tmp_path_factory.mktemp("fp8"), config, random_weights(config, 3), dtype="bfloat16")


PROMPTS = [[1, 2, 3, 4], [5, 6, 7], list(range(10, 90)), [300] * 5]
GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=5)
SETTINGS = dict(max_num_seqs=8, max_model_len=256, gpu_memory_utilization=0.3)


def generate(model_dir, **settings):
    with LLM(model_dir, **{**SETTINGS, **settings}) as llm:
        return [o.outputs[0] for o in llm.generate(PROMPTS, GREEDY)]


def test_fp8_through_the_engine_with_cuda_graphs(model_dir):
    """LLM(quantization="fp8") on cuda: decode graphs replay what eager steps compute (same greedy tokens); the
    completions follow the numpy backend's fp8 ones (agreement reported) and are reported next to bf16's."""
    graphs = generate(model_dir, backend="cuda", quantization="fp8", cuda_graph_capture="eager")
    eager = generate(model_dir, backend="cuda", quantization="fp8", enforce_eager=True)
    assert [o.token_ids for o in graphs] == [o.token_ids for o in eager]
    numpy = generate(model_dir, backend="numpy", quantization="fp8")
    bf16 = generate(model_dir, backend="cuda")
    agreed = [agreed_tokens(want, got, margin=0.5, tolerance=0.25) for want, got in zip(numpy, graphs)]
    total = sum(len(o.token_ids) for o in numpy)
    same_as_bf16 = np.mean([a == b for x, y in zip(graphs, bf16) for a, b in zip(x.token_ids, y.token_ids)])
    print(f"REPORT fp8 engine cuda vs numpy fp8: {sum(agreed)}/{total} greedy tokens agree before a divergence; "
          f"tokens equal to cuda bf16's: {same_as_bf16:.3f}")
    assert sum(agreed) >= 0.5 * total
