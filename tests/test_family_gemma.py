"""Gemma 2 and Gemma 3 (text) on the numpy backend against HF transformers (float32, eager attention): GeGLU,
(1 + weight) RMSNorm, scaled embeddings, the norms around attention and MLP, soft-capping, query_pre_attn_scalar,
sliding layers (with their own RoPE base in Gemma 3) and q/k norms; the multimodal checkpoint's language model;
and the cuda refusal."""

import json

import numpy as np
import pytest
from helpers import compare_with_hf, llm_for, ok_run, one_line_error, run, write_jsonl

from tinyvllm import SamplingParams, TokensPrompt
from tinyvllm.backends.base import check_cuda_kernels
from tinyvllm.model.config import ModelConfig
from tinyvllm.model.dummy import random_weights, save_hf_model_dir, tiny_config
from tinyvllm.model.rope import layer_ropes

pytestmark = pytest.mark.slow

SLIDE, FULL = "sliding_attention", "full_attention"
GEMMA = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, hidden_size=64, tie_word_embeddings=True,
             activation="gelu_pytorch_tanh", query_pre_attn_scalar=24, max_position_embeddings=128)
GEMMA2 = dict(GEMMA, architecture="Gemma2ForCausalLM", sliding_window=5, layer_types=(SLIDE, FULL),
              attn_logit_softcapping=2.0, final_logit_softcapping=3.0)
GEMMA3 = dict(GEMMA, architecture="Gemma3ForCausalLM", num_hidden_layers=3, sliding_window=6,
              layer_types=(SLIDE, SLIDE, FULL), rope_theta=1e6, local_rope_theta=10000.0,
              rope_scaling={"rope_type": "linear", "factor": 4.0})


def prompts(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 512, n).tolist() for n in lengths]


def test_gemma2_matches_hf_across_its_windows(tmp_path):
    config = tiny_config(**GEMMA2)
    err = compare_with_hf(tmp_path, config, prompts([4, 13, 22]), block_size=4, max_model_len=128)
    assert err <= 1e-4


def test_gemma3_matches_hf_with_two_rope_bases(tmp_path):
    config = tiny_config(**GEMMA3)
    ropes = layer_ropes(config)
    assert ropes[0] is ropes[1] and ropes[2] is not ropes[0]  # the sliding layers' base is the local one
    err = compare_with_hf(tmp_path, config, prompts([9, 20, 3]), block_size=4, max_model_len=128)
    assert err <= 1e-4


HUB_GEMMA2_2B = dict(architectures=["Gemma2ForCausalLM"], model_type="gemma2", vocab_size=256000, hidden_size=2304,
                     intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8, num_key_value_heads=4,
                     head_dim=256, hidden_act="gelu_pytorch_tanh", hidden_activation="gelu_pytorch_tanh",
                     max_position_embeddings=8192, rms_norm_eps=1e-6, rope_theta=10000.0, sliding_window=4096,
                     attn_logit_softcapping=50.0, final_logit_softcapping=30.0, query_pre_attn_scalar=256,
                     bos_token_id=2, eos_token_id=1, torch_dtype="float32", attention_bias=False)
# gemma-3-4b-it's config.json: the text config holds only what differs from Gemma3TextConfig's defaults.
HUB_GEMMA3_4B = dict(architectures=["Gemma3ForConditionalGeneration"], model_type="gemma3", bos_token_id=2,
                     eos_token_id=[1, 106], torch_dtype="bfloat16", vision_config={"hidden_size": 1152},
                     text_config={"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                                  "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                                  "sliding_window": 1024})


def test_gemma_hub_configs():
    g2 = ModelConfig.from_hf_dict(HUB_GEMMA2_2B)
    assert (g2.activation, g2.norm_offset, g2.attention_scale) == ("gelu_pytorch_tanh", 1.0, 256 ** -0.5)
    assert g2.layer_windows[:3] == [4096, None, 4096] and g2.embed_scale == pytest.approx(48.0)
    assert g2.tie_word_embeddings and g2.final_logit_softcapping == 30.0
    g3 = ModelConfig.from_hf_dict(HUB_GEMMA3_4B)
    assert (g3.hidden_size, g3.num_hidden_layers, g3.vocab_size, g3.head_dim) == (2560, 34, 262208, 256)
    assert g3.layer_windows[:6] == [1024] * 5 + [None] and g3.qk_norm and g3.eos_token_ids == [1, 106]
    assert g3.local_rope_theta == 10000.0 and g3.rope_theta == 1e6 and g3.rope_scaling["factor"] == 8.0
    assert g3.attn_logit_softcapping is None
    v5 = dict(HUB_GEMMA3_4B["text_config"], architectures=["Gemma3ForCausalLM"], rope_scaling=None,
              rope_parameters={FULL: {"rope_type": "default", "rope_theta": 5e5},
                               SLIDE: {"rope_type": "default", "rope_theta": 1e4}})
    assert (ModelConfig.from_hf_dict(v5).rope_theta, ModelConfig.from_hf_dict(v5).local_rope_theta) == (5e5, 1e4)
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        ModelConfig.from_hf_dict(dict(v5, use_bidirectional_attention=True))


def test_gemma3_multimodal_checkpoint_runs_its_language_model(tmp_path):
    """A Gemma3ForConditionalGeneration checkpoint: the language model's tensors under language_model., the vision
    tower's skipped; the same greedy tokens and logprobs as the text-only checkpoint of those tensors."""
    text = tiny_config(**GEMMA3)
    weights = random_weights(text, seed=3)
    text_dir = save_hf_model_dir(tmp_path / "text", text, weights)
    mm = ModelConfig(**{**text.__dict__, "architecture": "Gemma3ForConditionalGeneration"})
    mm_weights = {"language_model." + name: w for name, w in weights.items()}
    mm_weights["vision_tower.vision_model.post_layernorm.weight"] = np.ones(8, np.float32)
    mm_dir = save_hf_model_dir(tmp_path / "mm", mm, mm_weights)
    config_json = json.loads((mm_dir / "config.json").read_text())
    text_config = {k: v for k, v in config_json.items() if k not in ("architectures", "model_type")}
    (mm_dir / "config.json").write_text(json.dumps({"architectures": ["Gemma3ForConditionalGeneration"],
                                                    "model_type": "gemma3", "text_config": text_config}))
    params = SamplingParams(temperature=0.0, max_tokens=4, logprobs=0, ignore_eos=True)
    runs = []
    for model_dir in (text_dir, mm_dir):
        with llm_for(model_dir, block_size=4, max_model_len=64) as llm:
            runs.append(llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts([5, 11])], params))
    for a, b in zip(*runs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].cumulative_logprob == pytest.approx(b.outputs[0].cumulative_logprob, abs=1e-5)


@pytest.mark.parametrize("family", [GEMMA2, GEMMA3])
def test_cuda_has_the_gemma_layer_ops(family):
    """GeGLU, (1 + weight) RMSNorm, scaled embeddings, sandwich norms, q/k norms and the final-logit soft cap run on
    the cuda backend: a Gemma config without windows, attention soft cap or RoPE variants is not refused."""
    attention = dict(sliding_window=None, layer_types=None, attn_logit_softcapping=None, query_pre_attn_scalar=None,
                     local_rope_theta=None, rope_scaling=None)
    config = tiny_config(**{**family, **attention, "head_dim": 64})  # a head_dim the attention kernels have
    assert config.sandwich_norms and config.norm_offset == 1 and config.embed_scale == 8
    check_cuda_kernels(config, 128)


# Gemma 2's chat template as its tokenizer_config.json carries it: no system role.
GEMMA2_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
    "{% endif %}{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{'<start_of_turn>model\\n'}}{% endif %}")


def test_gemma_system_row_is_an_error_row_naming_the_reason(tmp_path):
    model = save_hf_model_dir(tmp_path / "model", tiny_config(**GEMMA2), random_weights(tiny_config(**GEMMA2)))
    tok_config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps(dict(tok_config, chat_template=GEMMA2_TEMPLATE)))
    src = write_jsonl(tmp_path / "in.jsonl", [
        {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]},
        {"messages": [{"role": "user", "content": "hi"}]}])
    rows = ok_run(model, src, tmp_path / "out.parquet", "--max-tokens", "2", "--backend", "numpy").to_pylist()
    assert rows[0]["finish_reason"] == "error"
    assert rows[0]["error"] == "chat template failed: System role not supported"
    assert rows[1]["error"] is None and rows[1]["finish_reason"] == "length"


def test_cuda_backend_takes_gemma():
    check_cuda_kernels(tiny_config(**dict(GEMMA2, head_dim=64)), 2048)  # windows, soft caps, GeGLU, sandwich norms
    check_cuda_kernels(tiny_config(**dict(GEMMA3, head_dim=64)), 2048)


def test_new_family_configs_round_trip_through_config_json():
    from test_family_phi3 import PHI, longrope

    phi4 = tiny_config(**PHI, partial_rotary_factor=0.75, rope_scaling=longrope(6, 32), max_position_embeddings=256)
    for config in (tiny_config(**GEMMA2), tiny_config(**GEMMA3), phi4, tiny_config(**PHI, sliding_window=6)):
        assert ModelConfig.from_hf_dict(json.loads(json.dumps(config.to_hf_dict()))) == config


def test_image_content_parts_are_refused_in_one_line():
    from tinyvllm.model.dummy import build_tokenizer
    from tinyvllm.tokenizer import Tokenizer

    tok = Tokenizer(build_tokenizer(512), chat_template=GEMMA2_TEMPLATE)
    image = [{"role": "user", "content": [{"type": "image", "url": "cat.png"}, {"type": "text", "text": "what?"}]}]
    with pytest.raises(ValueError, match="message 0 has a content part of type 'image': tinyvllm takes text only"):
        tok.apply_chat_template(image)
    text = [{"role": "user", "content": [{"type": "text", "text": "what?"}]}]
    assert "what?" in tok.apply_chat_template(text)


def test_backend_auto_runs_on_the_cpu_a_gemma_the_cuda_kernels_lack(tmp_path, monkeypatch, caplog):
    import tinyvllm.backends as backends
    from tinyvllm.backends.numpy_backend import NumpyBackend

    monkeypatch.setattr(backends, "cuda_unavailable_reason", lambda: None)  # as on a machine with a usable GPU
    monkeypatch.setattr(backends, "gpu_present", lambda: True)
    config = tiny_config(**GEMMA2, partial_rotary_factor=0.25)  # 4 rotary dims: rope_and_cache rotates 8 at a time
    model = save_hf_model_dir(tmp_path / "model", config, random_weights(config))
    with caplog.at_level("WARNING", logger="tinyvllm.backends"):
        from tinyvllm import LLM

        with LLM(str(model), backend="auto", max_model_len=64, max_num_seqs=2) as llm:
            assert isinstance(llm.llm_engine.backend, NumpyBackend)
    assert "the cuda backend has no kernels yet for this Gemma2ForCausalLM model's" in caplog.text
