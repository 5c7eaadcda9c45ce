"""Structured outputs on the GPU: the token-bitmask kernel against its numpy twin on fresh random masks, then the
engine end to end (the forward queued before the masks are filled, decode graphs and eager, prefill) against the
numpy backend and the constraints themselves."""

import json
import re
from dataclasses import replace

import numpy as np
import pytest

from agreement import agreed_tokens
from tinyvllm import LLM, SamplingParams
from tinyvllm.backends import sampler
from tinyvllm.model.dummy import random_weights, save_hf_model_dir, smollm2_135m_config

pytestmark = pytest.mark.gpu
llguidance = pytest.importorskip("llguidance")


@pytest.mark.parametrize("rows,vocab", [(9, 1000), (40, 49152)])
def test_token_bitmask_matches_numpy(cuda, ops, rows, vocab):
    rng = np.random.default_rng(rows)
    words = (vocab + 31) // 32
    bitmask = rng.integers(-2**31, 2**31, size=(rows // 2, words), dtype=np.int64).astype(np.int32)
    bitmask[0] = 0  # nothing allowed
    bitmask_rows = np.where(rng.random(rows) < 0.6, rng.integers(0, len(bitmask), rows), -1).astype(np.int32)
    logits = (rng.standard_normal((rows, vocab)) * 4).astype(np.float32)
    want = logits.copy()
    sampler.apply_token_bitmask(want, bitmask, bitmask_rows)
    d_logits = cuda.to_device(logits)
    ops.apply_token_bitmask(d_logits, rows, vocab, cuda.to_device(bitmask), cuda.to_device(bitmask_rows))
    got = cuda.from_device(d_logits, (rows, vocab), np.float32)
    assert np.array_equal(got, want)
    assert np.isinf(want).any() and (bitmask_rows < 0).any()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    config = replace(smollm2_135m_config(), num_hidden_layers=2)
    return save_hf_model_dir(tmp_path_factory.mktemp("smollm2_2l"), config, random_weights(config, 7),
                             dtype="bfloat16")


SCHEMA = {"type": "object", "additionalProperties": False, "required": ["a", "b"],
          "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999},
                         "b": {"type": "array", "items": {"enum": ["x", "yy"]}, "maxItems": 4}}}


def _check(text: str, constraint: dict) -> None:
    if "json" in constraint:
        value = json.loads(text)
        assert set(value) == {"a", "b"} and 0 <= value["a"] <= 999 and set(value["b"]) <= {"x", "yy"}
    elif "regex" in constraint:
        assert re.fullmatch(constraint["regex"], text)
    else:
        assert text in constraint["choice"]


def test_constrained_requests_through_the_pipelined_engine(cuda, model_dir):
    """Constrained rows batched with free ones (penalties, logprobs, n > 1) on the GPU, graphs and eager: every
    token is one its matcher allows, complete outputs meet their constraint, and greedy rows follow the numpy
    backend for as long as no near-tie splits them."""
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 2000, rng.integers(4, 60)).tolist() for _ in range(12)]
    constraints = [{"json": SCHEMA, "disable_any_whitespace": True}, {"regex": r"[a-f]{4,12}"},
                   {"choice": ["alpha", "beta", "gamma delta"]}, None]
    params = [SamplingParams(max_tokens=40, temperature=0 if i % 3 else 0.9, seed=i, logprobs=4,
                             n=2 if i == 4 else 1, frequency_penalty=0.5 if i % 4 == 1 else 0.0,
                             structured_outputs=constraints[i % 4]) for i in range(len(prompts))]
    outs = {}
    for backend, eager in (("numpy", False), ("cuda", False), ("cuda", True)):
        llm = LLM(model_dir, backend=backend, max_num_seqs=8, num_kv_blocks=256, max_model_len=512,
                  enforce_eager=eager)
        outs[backend, eager] = llm.generate(prompts, params)
        if backend == "cuda":
            if not eager:
                assert llm.backend.graphs.forward_only, "constrained decode steps ran the forward-only graphs"
                manager = llm.llm_engine.structured_outputs
            llm.backend.close()
    for i, (out, p) in enumerate(zip(outs["cuda", False], params)):
        for comp in out.outputs:
            if p.structured_outputs is None:
                continue
            matcher = manager.constraint(p.structured_outputs).matcher
            for token in comp.token_ids:
                assert matcher.consume_token(token), "a token its constraint forbids"
            if comp.finish_reason == "stop":
                _check(comp.text, constraints[i % 4])
    for graphs, eager in zip(outs["cuda", False], outs["cuda", True]):
        assert [c.token_ids for c in graphs.outputs] == [c.token_ids for c in eager.outputs]
    agreed = 0
    for want, got, p in zip(outs["numpy", False], outs["cuda", False], params):
        if p.temperature or p.n > 1:
            continue
        agreed += agreed_tokens(want.outputs[0], got.outputs[0])
    assert agreed >= 40, f"only {agreed} tokens agreed"
    print(f"REPORT structured outputs: {agreed} greedy tokens agree with numpy; graphs == eager")
