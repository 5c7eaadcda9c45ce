"""vLLM's offline API where scripts port to tinyvllm unchanged: LLM's keyword arguments, generate()'s errors and
prompt types, SamplingParams' output fields, the HF-tokenizer subset, llm_engine.model_config."""

import shutil
import sys
import types

import numpy as np
import pytest
from helpers import require

from tinyvllm import LLM, SamplingParams, TextPrompt, TokensPrompt
from tinyvllm.backends import create_backend
from tinyvllm.config import EngineConfig
from tinyvllm.model.loader import load_model

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def numpy_llm(model, **kw):
    return LLM(model, backend="numpy", **kw)


def assert_engine_empty(llm):
    bm = llm.llm_engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not any(bm.ref_counts)
    assert not llm.llm_engine.has_unfinished_requests()


def test_vllm_keywords_at_their_defaults_are_accepted(tiny_model_dir):
    llm = numpy_llm(tiny_model_dir, tensor_parallel_size=1, quantization=None, trust_remote_code=False,
                    revision=None, tokenizer_mode="auto", max_num_seqs=None, seed=None, dtype="float32",
                    enforce_eager=True, gpu_memory_utilization=0.5, swap_space=4, disable_log_stats=True,
                    max_model_len=64)
    assert llm.engine_config.max_num_seqs == EngineConfig().max_num_seqs  # None: the default
    assert llm.engine_config.seed == EngineConfig().seed
    assert llm.llm_engine.model_config.max_model_len == 64
    assert llm.generate("Hello", GREEDY)[0].error is None


@pytest.mark.parametrize("kwargs, name", [
    ({"tensor_parallel_size": 2}, "tensor_parallel_size=2"),
    ({"pipeline_parallel_size": 2}, "pipeline_parallel_size=2"),
    ({"trust_remote_code": True}, "trust_remote_code=True"), ({"revision": "main"}, "revision='main'"),
    ({"enable_lora": True}, "enable_lora=True"),
])
def test_vllm_keywords_tinyvllm_cannot_honour_raise_one_clear_error(tiny_model_dir, kwargs, name):
    with pytest.raises(ValueError, match=f"^{name} is not supported"):
        numpy_llm(tiny_model_dir, **kwargs)


def test_unknown_keyword_and_wrong_dtype_raise(tiny_model_dir):
    with pytest.raises(TypeError, match="no_such_setting"):
        numpy_llm(tiny_model_dir, no_such_setting=1)
    with pytest.raises(ValueError, match="numpy backend computes in float32"):
        numpy_llm(tiny_model_dir, dtype="bfloat16")
    with pytest.raises(ValueError, match="invalid dtype='float16'"):
        numpy_llm(tiny_model_dir, dtype="float16")


def test_enforce_eager_turns_cuda_graphs_off(tiny_model_dir, monkeypatch):
    made = []

    class FakeCudaBackend:
        def __init__(self, model, config, use_graphs=True):
            made.append(use_graphs)

    runner = types.ModuleType("tinyvllm.backends.cuda.runner")
    runner.CudaBackend = FakeCudaBackend
    monkeypatch.setitem(sys.modules, "tinyvllm.backends.cuda.runner", runner)
    model = load_model(tiny_model_dir)
    create_backend(model, EngineConfig(backend="cuda"))
    create_backend(model, EngineConfig(backend="cuda", enforce_eager=True))
    assert made == [True, False]
    with pytest.raises(ValueError, match="cuda backend computes in bfloat16"):
        create_backend(model, EngineConfig(backend="cuda", dtype="float32"))


def test_separate_tokenizer_dir(tiny_model_dir, tmp_path):
    model_dir, tokenizer_dir = tmp_path / "model", tmp_path / "tokenizer"
    shutil.copytree(tiny_model_dir, model_dir)
    tokenizer_dir.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.move(model_dir / name, tokenizer_dir / name)
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        numpy_llm(model_dir)
    split = numpy_llm(model_dir, tokenizer=str(tokenizer_dir)).generate("The quick brown fox", GREEDY)[0]
    whole = numpy_llm(tiny_model_dir).generate("The quick brown fox", GREEDY)[0]
    assert (split.prompt_token_ids, split.outputs[0].text) == (whole.prompt_token_ids, whole.outputs[0].text)


def test_generate_raises_for_a_request_it_cannot_serve_and_leaves_the_engine_empty(tiny_model_dir):
    llm = numpy_llm(tiny_model_dir, max_model_len=32)
    with pytest.raises(ValueError, match="^prompt 1: prompt has .* tokens; the limit is 31"):
        llm.generate(["ok", "word " * 100, "also ok"], GREEDY)
    assert_engine_empty(llm)
    with pytest.raises(ValueError, match="^prompt 0: empty prompt"):
        llm.generate([""], GREEDY)
    assert_engine_empty(llm)
    outs = llm.generate(["ok", "word " * 100], GREEDY, error_outputs=True)
    assert outs[0].error is None and "max_model_len" in outs[1].error
    assert llm.generate("ok", GREEDY)[0].outputs[0].token_ids == outs[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="lora_request"):
        llm.generate("ok", GREEDY, lora_request=object())
    assert llm.generate("ok", GREEDY, priority=None)[0].outputs[0].token_ids == outs[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="^priority: tinyvllm schedules first come, first served"):
        llm.generate("ok", GREEDY, priority=[1])


def test_prompt_types(tiny_model_dir):
    llm = numpy_llm(tiny_model_dir)
    ids = llm.tokenizer.encode("Once upon a time")
    by_text, by_ids, as_text, as_ids = llm.generate(
        [TextPrompt(prompt="Once upon a time"), TokensPrompt(prompt_token_ids=ids), "Once upon a time", ids], GREEDY)
    assert by_text.prompt == "Once upon a time" and by_ids.prompt_token_ids == ids
    assert by_text.outputs[0].token_ids == by_ids.outputs[0].token_ids == as_text.outputs[0].token_ids \
        == as_ids.outputs[0].token_ids
    with pytest.raises(ValueError, match="multi_modal_data"):
        llm.generate({"prompt": "x", "multi_modal_data": {}}, GREEDY)


def test_detokenize_and_skip_special_tokens(tiny_model_dir):
    model = load_model(tiny_model_dir)
    # A zero LM head makes every logit equal, so greedy picks token 0: <|endoftext|>, special but not EOS.
    model.weights["lm_head.weight"] = np.zeros_like(model.weights["lm_head.weight"])
    llm = numpy_llm(model)
    special = llm.tokenizer.decode(0, skip_special_tokens=False)
    for stop in ([], ["never written"]):  # decoded at the end, and token by token (stop strings)
        params = SamplingParams(max_tokens=3, temperature=0, stop=stop)
        skipped, kept = llm.generate(["Hi", "Hi"], [params, SamplingParams(**{**vars(params),
                                                                            "skip_special_tokens": False})])
        assert skipped.outputs[0].token_ids == kept.outputs[0].token_ids == [0, 0, 0]
        assert (skipped.outputs[0].text, kept.outputs[0].text) == ("", special * 3)
    silent = llm.generate("Hi", SamplingParams(max_tokens=3, temperature=0, detokenize=False,
                                               skip_special_tokens=False))[0]
    assert silent.outputs[0].token_ids == [0, 0, 0] and silent.outputs[0].text == ""


def test_sampling_params_vllm_fields_checked():
    assert SamplingParams(n=1, spaces_between_special_tokens=False).spaces_between_special_tokens is False
    with pytest.raises(ValueError, match="invalid n=0"):
        SamplingParams(n=0)
    with pytest.raises(ValueError, match="invalid detokenize=False: stop strings need the text"):
        SamplingParams(stop=["x"], detokenize=False)
    with pytest.raises(ValueError, match="invalid skip_special_tokens"):
        SamplingParams(skip_special_tokens="no")


def test_tokenizer_offers_the_hf_subset(tiny_model_dir):
    transformers = require("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(tiny_model_dir))
    tok = numpy_llm(tiny_model_dir).get_tokenizer()
    assert (tok.bos_token_id, tok.eos_token_id) == (hf.bos_token_id, hf.eos_token_id) == (1, 2)
    assert tok.pad_token_id == tok.eos_token_id
    texts = ["Hello there", "émoji 🙂"]
    assert tok(texts).input_ids == hf(texts).input_ids and tok(texts)["attention_mask"] == hf(texts).attention_mask
    assert tok(texts[0], return_attention_mask=False) == {"input_ids": hf(texts[0]).input_ids}
    assert tok.encode(texts[1]) == hf.encode(texts[1])
    ids = hf.encode(texts[1])
    assert tok.decode(ids) == hf.decode(ids) and tok.decode(ids[0]) == hf.decode(ids[0])
    assert tok.decode(np.int64(2), skip_special_tokens=False) == "<|im_end|>"
    messages = [{"role": "user", "content": "hi"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert tok.apply_chat_template(messages, tokenize=True) == tok.encode_prompt(text, templated=True)
