"""The MoE router and grouped expert op of the numpy backend (backends/moe.py, backends/topk.py) against HF's sparse
MoE blocks and torch.topk: ties, an expert no token chose, a single token, the grouping contract."""

import importlib

import numpy as np
import pytest
from helpers import require

from tinyvllm.backends.moe import StackedWeight, fused_moe, group_by_expert, route
from tinyvllm.backends.numpy_backend import silu_and_mul
from tinyvllm.backends.topk import topk
from tinyvllm.model.dummy import tiny_config

torch = require("torch")
transformers = require("transformers")

FAMILIES = {
    "mixtral": dict(architecture="MixtralForCausalLM", num_experts=8, num_experts_per_tok=2),
    "qwen3_moe": dict(architecture="Qwen3MoeForCausalLM", num_experts=16, num_experts_per_tok=4, norm_topk_prob=True),
    "olmoe": dict(architecture="OlmoeForCausalLM", num_experts=64, num_experts_per_tok=8),
}
HIDDEN, WIDTH = 32, 24


def tie_rows(rng, rows, n):
    """Rows of few distinct values: ties everywhere, at the top-k boundary too."""
    return rng.integers(0, int(rng.integers(1, 4)) + 1, (rows, n)).astype(np.float32)


@pytest.mark.parametrize("n, k", [(8, 2), (8, 8), (16, 4), (64, 8), (128, 8), (128, 2), (200, 3), (60, 20)])
def test_topk_is_torch_topk_with_ties(n, k):
    rng = np.random.default_rng(n * 100 + k)
    values = np.concatenate([tie_rows(rng, 200, n), rng.standard_normal((20, n)).astype(np.float32)])
    expected = torch.topk(torch.from_numpy(values), k, dim=-1).indices.numpy()
    assert np.array_equal(topk(values, k), expected)


def test_topk_of_equal_values_is_not_lowest_index_first():
    # what torch does on a row of equal values (so a stable-sort rule would fail the HF comparison)
    values = np.zeros((1, 8), np.float32)
    assert topk(values, 3).tolist() == torch.topk(torch.zeros(1, 8), 3).indices.tolist() != [[0, 1, 2]]


def hf_block(name, rng, router=None):
    config = tiny_config(hidden_size=HIDDEN, intermediate_size=WIDTH, moe_intermediate_size=WIDTH, **FAMILIES[name])
    d = config.to_hf_dict()
    hf_config = transformers.AutoConfig.for_model(d.pop("model_type"), **d)
    cls_name = {"mixtral": "MixtralSparseMoeBlock", "qwen3_moe": "Qwen3MoeSparseMoeBlock",
                "olmoe": "OlmoeSparseMoeBlock"}[name]
    cls = getattr(importlib.import_module(f"transformers.models.{name}.modeling_{name}"), cls_name)
    block = cls(hf_config).eval()
    e = config.num_experts
    weights = {"router": rng.standard_normal((e, HIDDEN), dtype=np.float32) if router is None else router,
               "gate_up": rng.standard_normal((e, 2 * WIDTH, HIDDEN), dtype=np.float32) / np.sqrt(HIDDEN),
               "down": rng.standard_normal((e, HIDDEN, WIDTH), dtype=np.float32) / np.sqrt(WIDTH)}
    with torch.no_grad():
        block.gate.weight.copy_(torch.from_numpy(weights["router"]))
        block.experts.gate_up_proj.copy_(torch.from_numpy(weights["gate_up"]))
        block.experts.down_proj.copy_(torch.from_numpy(weights["down"]))
    return config, block, weights


def ours(config, weights, x):
    w, ids = route(x @ weights["router"].T, config.num_experts_per_tok, config.norm_topk_prob)
    out = fused_moe(x, StackedWeight.from_rows(weights["gate_up"]), StackedWeight.from_rows(weights["down"]), w, ids,
                    silu_and_mul)
    return out, w, ids


def router_cases(rng, e):
    unchosen = rng.standard_normal((e, HIDDEN), dtype=np.float32)
    unchosen[3] = 0.0  # logit 0, far below the others' (x is made positive for this case)
    unchosen[:, :] = np.abs(unchosen)
    unchosen[3] = -1.0
    tied = rng.standard_normal((e, HIDDEN), dtype=np.float32)
    tied[1::2] = tied[0::2]  # experts 2j and 2j + 1 always tie
    return {"random": None, "all-tied": np.zeros((e, HIDDEN), np.float32), "pairs-tied": tied, "unchosen": unchosen}


@pytest.mark.parametrize("case", ["random", "all-tied", "pairs-tied", "unchosen"])
@pytest.mark.parametrize("num_tokens", [1, 13])
@pytest.mark.parametrize("name", list(FAMILIES))
def test_moe_block_matches_hf(name, num_tokens, case):
    rng = np.random.default_rng(7)
    router = router_cases(rng, FAMILIES[name]["num_experts"])[case]
    config, block, weights = hf_block(name, rng, router)
    x = rng.standard_normal((num_tokens, HIDDEN), dtype=np.float32)
    if case == "unchosen":
        x = np.abs(x)
    out, w, ids = ours(config, weights, x)
    with torch.no_grad():
        _, hf_w, hf_ids = block.gate(torch.from_numpy(x))
        ref = block(torch.from_numpy(x)[None])[0].numpy()
    assert np.array_equal(ids, hf_ids.numpy())  # the same experts, in the same order, ties included
    assert np.allclose(w, hf_w.numpy(), rtol=1e-5, atol=1e-6)
    assert np.abs(out - ref).max() <= 1e-5 * max(1.0, np.abs(ref).max())
    if case == "unchosen":
        assert 3 not in ids and np.diff(group_by_expert(ids, config.num_experts)[1])[3] == 0


def test_route_normalization():
    logits = np.random.default_rng(1).standard_normal((5, 8)).astype(np.float32)
    probs = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    w, ids = route(logits, 3, renormalize=False)
    assert np.allclose(w, np.take_along_axis(probs, ids, -1), rtol=1e-6)
    assert (np.diff(w, axis=-1) <= 0).all()  # highest first
    w2, ids2 = route(logits, 3, renormalize=True)
    assert np.array_equal(ids, ids2) and np.allclose(w2.sum(-1), 1.0, atol=1e-6)
    chosen = np.take_along_axis(logits, ids, -1)  # Mixtral's: the softmax over the chosen logits
    assert np.allclose(w2, np.exp(chosen) / np.exp(chosen).sum(-1, keepdims=True), rtol=1e-5)


def test_group_by_expert_contract():
    ids = np.array([[2, 0], [0, 2], [3, 0], [2, 3]])
    order, offsets = group_by_expert(ids, 5)
    assert offsets.tolist() == [0, 3, 3, 6, 8, 8]  # experts 1 and 4: empty runs
    # assignment = token * k + slot; each run in token order
    assert order.tolist() == [1, 2, 5, 0, 3, 6, 4, 7]
    flat = ids.reshape(-1)
    for e in range(5):
        assert (flat[order[offsets[e]:offsets[e + 1]]] == e).all()
