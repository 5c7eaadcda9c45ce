"""The CUDA backend against the numpy backend on the mixture-of-experts families (Qwen3-MoE with a dense layer,
Mixtral, OLMoE's unnormalized top-8 and whole-projection q/k norms) and on two layers of Qwen3-30B-A3B's shapes and
one of Mixtral-8x7B's, on random weights rounded to bf16 so that both sides compute with the same weights: prefill
chunks take the grouped GEMM (and the GEMV kernels for a short last chunk), decode steps the GEMV kernels
(ops.moe_uses_gemv).

A router near-tie decides differently in bf16 and in float32: a decode step of three rows with one token's expert
swapped is off by ~10% (and the swapped token's K/V stays in the cache). So the comparison is routed alike: the
cuda backend runs eagerly with each expert layer's choice (topk_ids) and router logits read back, and the numpy
backend takes those experts, weighted by its own router's probabilities. What is checked, each step:
- cuda's experts are the top-k of cuda's own router logits (a wrong pick fails), and its router logits within
  TOLERANCE of the reference's: so an expert choice that differs from the float32 reference's own top-k is a
  near-tie within the router logits' bf16 error (reported: how many, and the worst gap in the reference's logits
  as a multiple of that row's largest router-logit error);
- the final logits within TOLERANCE of the reference (a wrong expert product, weight, tile or slot sum fails);
- a second cuda backend that replays the decode steps as CUDA graphs (bucket-padded rows included) gives the eager
  one's logits.
quantization="fp8" (e4m3 experts) is checked against the numpy backend's W8A8 the same way; FP8 checkpoints of a
MoE model against the numpy backend on the same file (experts with channel or tensor scales, run as stored) and
against HF with the same quantization (block-scaled experts, run as bf16 weights). REPORT lines carry the measured
numbers (pytest -s)."""

import threading
from dataclasses import replace

import numpy as np
import pytest

from tinyvllm.backends import numpy_backend
from tinyvllm.backends.cuda.ops import moe_block_m, moe_uses_gemv
from tinyvllm.backends.cuda.tensors import BF16, E4M3
from tinyvllm.backends.numpy_backend import NumpyBackend
from tinyvllm.config import EngineConfig
from tinyvllm.engine.block_manager import BlockManager
from tinyvllm.model.dummy import mixtral_8x7b_config, qwen3_30b_a3b_config, tiny_config

from test_cuda_model import bf16_model, decode_batch, gpu_logits, make_seqs, prefill_batch, rel_err

pytestmark = pytest.mark.gpu

MOE = dict(hidden_size=1024, num_attention_heads=16, rms_norm_eps=1e-6, rope_theta=1e6)
FAMILIES = {
    # per-head q/k norms, renormalized top-8 of 32, layer 1 dense (mlp_only_layers)
    "qwen3-moe": dict(MOE, architecture="Qwen3MoeForCausalLM", num_key_value_heads=4, head_dim=128,
                      intermediate_size=1536, num_experts=32, num_experts_per_tok=8, norm_topk_prob=True,
                      moe_intermediate_size=256, mlp_only_layers=(1,)),
    # renormalized top-2 of 8, the experts as wide as Mixtral's ratio to hidden
    "mixtral": dict(MOE, architecture="MixtralForCausalLM", num_key_value_heads=8, head_dim=64,
                    intermediate_size=3584, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=3584),
    # unnormalized top-8 of 32, q/k norms over each token's whole Q and K
    "olmoe": dict(MOE, architecture="OlmoeForCausalLM", num_key_value_heads=16, head_dim=64, intermediate_size=512,
                  num_experts=32, num_experts_per_tok=8, norm_topk_prob=False, moe_intermediate_size=512),
}
TOLERANCE = 3e-2  # bf16 against float32, routed alike
GRAPH_TOLERANCE = 1e-3  # graph replay against the same launches run eagerly
# W8A8 on cuda against the numpy twin: the bound test_fp8_e2e.py sets for dense models, twice the twin's own change
# when its linear layers' inputs are rounded to bf16 (measured 9-11% of the logits' norm) plus 0.02: the GPU
# quantizes bf16 activations, the twin float32 ones
FP8_TOLERANCE = 0.24

# 64-token prefill chunks: the three prompts' 139 tokens are computed in three (64, 64, 11)
LIMITS = EngineConfig(block_size=16, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=512, num_kv_blocks=64)


class RoutingRecorder:
    """Wraps the forward's fused_moe: while `on`, each expert layer's topk_ids and router logits of the call's real
    rows are read back after it (the stream synchronized), per layer in call order, chunks concatenated."""

    def __init__(self, cuda, monkeypatch):
        from tinyvllm.backends.cuda import forward as cuda_forward  # pycuda: on a machine with a GPU

        self.cuda, self.on, self.layers = cuda, None, {}
        original = cuda_forward.fused_moe

        def recorded(ops, linear, buf, layer, x, h, n, cfg, *codes):
            original(ops, linear, buf, layer, x, h, n, cfg, *codes)
            if self.on == threading.get_ident():  # not another backend's capture thread
                self.cuda.Context.synchronize()
                ids = np.empty((n, cfg.num_experts_per_tok), np.int32)
                logits = np.empty((n, cfg.num_experts), np.float32)
                self.cuda.memcpy_dtoh(ids, buf.topk_ids.ptr)
                self.cuda.memcpy_dtoh(logits, buf.router_logits.ptr)
                self.layers.setdefault(id(layer), []).append((ids, logits))

        monkeypatch.setattr(cuda_forward, "fused_moe", recorded)

    def run(self, backend, batch):
        """backend.execute(batch), recorded: [(ids, logits) per expert layer], the rows of every chunk."""
        self.on, self.layers = threading.get_ident(), {}
        try:
            backend.execute(batch)
        finally:
            self.on = None
        return [tuple(np.concatenate(part) for part in zip(*calls)) for calls in self.layers.values()]


class ForcedRoute:
    """numpy_backend's route with the experts cuda chose (call i of a forward: expert layer i's), weighted by the
    reference's own probabilities; checks and counts every choice that differs from the reference's own top-k."""

    def __init__(self, monkeypatch):
        self.chosen, self.calls, self.swaps, self.worst = [], 0, 0, 0.0
        self.router_errors = []

        def route(logits, top_k, renormalize):
            ids, cuda_logits = self.chosen[self.calls]
            self.calls += 1
            ids, cuda_logits = ids[:len(logits)].astype(np.int64), cuda_logits[:len(logits)]
            self.check(logits, cuda_logits, ids, top_k)
            z = np.exp(logits - logits.max(axis=-1, keepdims=True))  # route's softmax
            weights = np.take_along_axis(z / z.sum(axis=-1, keepdims=True), ids, axis=-1)
            if renormalize:
                weights = weights / weights.sum(axis=-1, keepdims=True)
            return weights.astype(np.float32), ids

        monkeypatch.setattr(numpy_backend, "route", route)

    def start(self, chosen):
        self.chosen, self.calls = chosen, 0

    def check(self, logits, cuda_logits, ids, top_k):
        self.router_errors.append(rel_err(cuda_logits, logits))
        cuda_top = np.sort(np.argsort(-cuda_logits, axis=-1, kind="stable")[:, :top_k], axis=-1)
        assert (np.sort(ids, axis=-1) == cuda_top).all(), "cuda's experts are not the top-k of its router logits"
        ref_top = np.argsort(-logits, axis=-1, kind="stable")[:, :top_k]
        noise = np.abs(cuda_logits - logits).max(axis=-1)
        for row in np.flatnonzero((np.sort(ids, axis=-1) != np.sort(ref_top, axis=-1)).any(axis=-1)):
            left_out = np.setdiff1d(ref_top[row], ids[row])  # the reference's picks cuda did not take
            taken = np.setdiff1d(ids[row], ref_top[row])
            gap = float(logits[row, left_out].max() - logits[row, taken].min())
            self.swaps += 1
            self.worst = max(self.worst, gap / max(noise[row], 1e-12))  # <= 2: cuda's logits ranked them so


def compare(cuda, cuda_backend, monkeypatch, config, limits, name, tolerance=TOLERANCE):
    """Prefill three prompts, then 5 decode steps fed the numpy backend's greedy tokens, routed alike: the logits'
    relative errors, the swapped expert choices and the graph replay's distance from eager, reported and checked
    (the logits and router logits within `tolerance`)."""
    model = bf16_model(config, seed=3)
    recorder, forced = RoutingRecorder(cuda, monkeypatch), ForcedRoute(monkeypatch)
    eager = cuda_backend(model, limits, use_graphs=False)
    experts = [layer.experts_gate_up.dtype for layer in eager.forward.layers if layer.experts_gate_up is not None]
    assert experts and set(experts) == {E4M3 if limits.quantization == "fp8" else BF16}
    graphs = cuda_backend(model, replace(limits, cuda_graph_capture="eager"))  # every graph captured at start-up
    ref = NumpyBackend(model, limits)
    for backend in (eager, graphs, ref):
        backend.init_kv_cache()
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, config.vocab_size, n) for n in (9, 100, 30)]
    seqs = make_seqs(prompts)
    bm = BlockManager(EngineConfig(block_size=16, enable_prefix_caching=False), 64)
    batch = prefill_batch(seqs, bm, 16)
    errors, graph_errors, agree, tokens = [], [], [], None
    for step in range(6):
        if step:
            batch = decode_batch(seqs, tokens, bm, 16)
        forced.start(recorder.run(eager, batch))
        got = gpu_logits(cuda, eager, 3)
        graphs.execute(batch)
        graph_errors.append(rel_err(gpu_logits(cuda, graphs, 3), got))
        ref_logits = ref.forward(batch, batch.query_start_loc[1:] - 1)
        assert forced.calls == len(forced.chosen)  # every expert layer routed as cuda's
        errors.append(rel_err(got, ref_logits))
        tokens = ref_logits.argmax(-1)
        agree.append(np.mean(got.argmax(-1) == tokens))
    print(f"REPORT moe {name}: logits rel err prefill {errors[0]:.2e}, decode max {max(errors[1:]):.2e} (routed "
          f"alike); router logits rel err max {max(forced.router_errors):.2e}; {forced.swaps} expert choices "
          f"swapped by bf16 near-ties (worst gap {forced.worst:.2f}x the row's router error); graph vs eager max "
          f"{max(graph_errors):.1e}; greedy agree {np.mean(agree):.3f}")
    for backend in (eager, graphs):
        backend.close()
    assert max(errors) < tolerance and max(forced.router_errors) < tolerance
    assert max(graph_errors) < GRAPH_TOLERANCE


@pytest.mark.parametrize("name", list(FAMILIES))
def test_moe_family_logits_match_numpy(cuda, cuda_backend, monkeypatch, name):
    config = replace(tiny_config(**FAMILIES[name]), vocab_size=8192, num_hidden_layers=2)
    k, e = config.num_experts_per_tok, config.num_experts
    assert not moe_uses_gemv(LIMITS.max_num_batched_tokens, k, e) and moe_uses_gemv(11, k, e)  # both paths run
    compare(cuda, cuda_backend, monkeypatch, config, LIMITS, name)


def test_qwen3_30b_a3b_shaped_logits_match_numpy(cuda, cuda_backend, monkeypatch):
    """Qwen3-30B-A3B's widths and 128 experts (top 8), two layers; 256-token steps: the 139-token prefill in one
    chunk takes the grouped GEMM (a 64-token chunk would still take the GEMV kernels at 128 experts)."""
    config = replace(qwen3_30b_a3b_config(), vocab_size=8192, num_hidden_layers=2, bos_token_id=1,
                     eos_token_ids=[2])
    limits = replace(LIMITS, max_num_batched_tokens=256)
    assert not moe_uses_gemv(139, 8, 128) and moe_uses_gemv(4, 8, 128)
    compare(cuda, cuda_backend, monkeypatch, config, limits, "qwen3-30b-a3b x2 layers")


def test_mixtral_8x7b_shaped_logits_match_numpy(cuda, cuda_backend, monkeypatch):
    """Mixtral-8x7B's widths (hidden 4096, 8 experts of 14336, top 2, 8 KV heads of 128), one layer (1.4 B
    parameters, made and run on the host too): the 139 tokens prefill in a 128-token chunk (the grouped GEMM's
    64-row tiles) and an 11-token one (the GEMV kernels, as every decode step). (Its W8A8 form is left to the tiny
    Qwen3-MoE's test below: the numpy twin's quantization of 1.4 B weights takes minutes.)"""
    config = replace(mixtral_8x7b_config(), vocab_size=8192, num_hidden_layers=1)
    limits = replace(LIMITS, max_num_batched_tokens=128)
    k, e = config.num_experts_per_tok, config.num_experts
    assert moe_block_m(128, k, e) == 64 and moe_uses_gemv(11, k, e)
    compare(cuda, cuda_backend, monkeypatch, config, limits, "mixtral-8x7b x1 layer")


def test_fp8_experts_follow_the_numpy_twin(cuda, cuda_backend, monkeypatch):
    """quantization="fp8" on Qwen3-MoE (its dense layer, attention and experts W8A8; the router bf16) against the
    numpy backend's W8A8, routed alike: both paths of the e4m3 expert kernels (a 64-token chunk of 32 experts takes
    the grouped GEMM, decode the GEMVs) within FP8_TOLERANCE, graph replay = eager."""
    config = replace(tiny_config(**FAMILIES["qwen3-moe"]), vocab_size=8192, num_hidden_layers=2)
    compare(cuda, cuda_backend, monkeypatch, config, replace(LIMITS, quantization="fp8"), "qwen3-moe fp8",
            FP8_TOLERANCE)


def fp8_experts_checkpoint(tmp_path, monkeypatch, scheme: str):
    """A Qwen3-MoE checkpoint whose experts alone are float8 in `scheme` (its attention and dense layer in the
    ignore list, left float) -> (its dir, its config, the dequantized weights)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import test_fp8_checkpoints
    from test_family_moe import CONFIGS

    config = {**CONFIGS["qwen3_moe"], **dict(hidden_size=256, head_dim=64, intermediate_size=128,
                                             moe_intermediate_size=128)}
    dense = [f"model.layers.{i}.self_attn.{p}_proj" for i in range(config["num_hidden_layers"]) for p in "qkvo"]
    dense += [f"model.layers.1.mlp.{p}_proj" for p in ("gate", "up", "down")]  # mlp_only_layers=(1,)
    quant, *rest = test_fp8_checkpoints.SCHEMES[scheme]
    monkeypatch.setitem(test_fp8_checkpoints.SCHEMES, "experts", ({**quant, "ignore": ["lm_head", *dense]}, *rest))
    path, cfg, weights, *_ = test_fp8_checkpoints.write_fp8_checkpoint(tmp_path / "fp8", "experts", **config)
    return path, cfg, weights


PROMPTS = [np.random.default_rng(i).integers(3, 500, 30).tolist() for i in range(3)]


def checkpoint_logprobs(source, backend, **settings):
    """Teacher-forced prompt logprobs of PROMPTS, and the cuda backend's expert dtype (None on numpy)."""
    from tinyvllm import LLM
    from test_fp8_weights import our_logprobs

    with LLM(str(source), backend=backend, max_model_len=128, **settings) as llm:
        experts = llm.llm_engine.backend.forward.layers[0].experts_gate_up.dtype if backend == "cuda" else None
        return our_logprobs(llm, PROMPTS), experts


@pytest.mark.parametrize("scheme", ["ct-channel", "fp8-tensor"])
def test_an_fp8_checkpoint_of_a_moe_model_runs_its_experts_as_stored(tmp_path, monkeypatch, scheme):
    """A Qwen3-MoE checkpoint whose experts alone are float8 with channel or tensor scales runs them W8A8 on cuda,
    its codes as stored with a scale per expert and row: against the numpy backend on the same file, teacher-forced,
    within twice the distance W8A8 experts put between the backends (quantization="fp8" on the dequantized
    weights) plus 0.02."""
    from tinyvllm.model.dummy import save_hf_model_dir

    pytest.importorskip("torch")
    path, cfg, weights = fp8_experts_checkpoint(tmp_path, monkeypatch, scheme)
    dequantized = save_hf_model_dir(tmp_path / "dequantized", cfg, weights)
    (cuda_stored, experts), (numpy_stored, _) = (checkpoint_logprobs(path, b) for b in ("cuda", "numpy"))
    assert experts == E4M3
    (cuda_w8a8, experts), (numpy_w8a8, _) = (checkpoint_logprobs(dequantized, b, quantization="fp8")
                                            for b in ("cuda", "numpy"))
    assert experts == E4M3
    apart, noise = np.abs(cuda_stored - numpy_stored).mean(), np.abs(cuda_w8a8 - numpy_w8a8).mean()
    print(f"REPORT fp8 moe checkpoint {scheme} (experts as stored) on cuda: against numpy on the same file, mean "
          f"|logprob diff| {apart:.4f}; W8A8 experts' own between the backends {noise:.4f}")
    assert apart < 2 * noise + 0.02, (apart, noise)


def test_a_block_scaled_fp8_checkpoint_of_a_moe_model_runs_its_experts_as_bf16_weights(tmp_path, monkeypatch):
    """A Qwen3-MoE checkpoint whose experts alone are float8 with 128 x 128 block scales runs on the cuda backend as
    the bf16 checkpoint of its dequantized weights does (each code times its scale, rounded to bf16: forward.py):
    the same teacher-forced logprobs, bit for bit, and near HF's on those weights (REPORT: how near, and the
    quantization's own error)."""
    from tinyvllm.model.dummy import random_weights, save_hf_model_dir

    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from test_family_moe import hf_model, hf_prompt_logprobs

    path, cfg, weights = fp8_experts_checkpoint(tmp_path, monkeypatch, "fp8-block")
    bf16 = save_hf_model_dir(tmp_path / "dequantized", cfg, weights, dtype="bfloat16")
    (fp8, experts), (ours_bf16, _) = (checkpoint_logprobs(source, "cuda") for source in (path, bf16))
    assert experts == BF16
    np.testing.assert_array_equal(fp8, ours_bf16)

    def logprobs(model):
        return np.concatenate([hf_prompt_logprobs(model, p) for p in PROMPTS])

    reference = logprobs(hf_model(save_hf_model_dir(tmp_path / "float32", cfg, weights)))
    unquantized = logprobs(hf_model(save_hf_model_dir(tmp_path / "float", cfg, random_weights(cfg, 6))))
    error, quantization = np.abs(fp8 - reference).mean(), np.abs(unquantized - reference).mean()
    print(f"REPORT fp8 block-scaled moe checkpoint on cuda: the bf16 checkpoint's logprobs exactly; mean |logprob "
          f"error| against HF float32 on the dequantized weights {error:.4f}; the quantization's own "
          f"{quantization:.4f}")
    assert error < quantization
