import json

import pytest

from tinyvllm.backends.base import check_cuda_kernels
from tinyvllm.model.config import ModelConfig
from tinyvllm.model.dummy import llama_3_2_1b_config, smollm2_135m_config, tiny_config

LLAMA3_SCALING = {"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192}

# config.json of meta-llama/Llama-3.2-1B-Instruct as the hub carries it.
HUB_LLAMA_3_2 = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False, "mlp_bias": False,
    "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "head_dim": 64, "hidden_act": "silu",
    "hidden_size": 2048, "intermediate_size": 8192, "max_position_embeddings": 131072, "num_attention_heads": 32,
    "num_hidden_layers": 16, "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
    "rope_scaling": {**LLAMA3_SCALING, "rope_type": "llama3"}, "tie_word_embeddings": True,
    "torch_dtype": "bfloat16", "vocab_size": 128256, "pretraining_tp": 1, "use_cache": True,
}


def test_hub_format():
    c = ModelConfig.from_hf_dict(HUB_LLAMA_3_2)
    assert (c.vocab_size, c.hidden_size, c.intermediate_size, c.num_hidden_layers) == (128256, 2048, 8192, 16)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (32, 8, 64)
    assert c.rope_theta == 500000.0 and c.rms_norm_eps == 1e-5 and c.max_position_embeddings == 131072
    assert c.rope_scaling == {"rope_type": "llama3", **LLAMA3_SCALING}
    assert c.tie_word_embeddings and c.bos_token_id == 128000 and c.eos_token_ids == [128001, 128008, 128009]
    assert c.torch_dtype == "bfloat16"
    assert c == llama_3_2_1b_config()


def test_legacy_rope_type_key_and_int_types_are_normalized():
    d = dict(HUB_LLAMA_3_2, rope_scaling={"type": "llama3", "factor": 8, "low_freq_factor": 1,
                                          "high_freq_factor": 4, "original_max_position_embeddings": 8192.0})
    rs = ModelConfig.from_hf_dict(d).rope_scaling
    assert rs == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192}
    assert isinstance(rs["factor"], float) and isinstance(rs["original_max_position_embeddings"], int)


@pytest.mark.parametrize("rs", [None, {}, {"rope_type": "default"}, {"type": "default"}])
def test_default_rope_is_none(rs):
    assert ModelConfig.from_hf_dict(dict(HUB_LLAMA_3_2, rope_scaling=rs)).rope_scaling is None


def test_transformers_v5_format():
    hub = {k: v for k, v in HUB_LLAMA_3_2.items() if k not in ("rope_theta", "rope_scaling", "torch_dtype")}
    v5 = dict(hub, dtype="bfloat16", rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, **LLAMA3_SCALING})
    assert ModelConfig.from_hf_dict(v5) == ModelConfig.from_hf_dict(HUB_LLAMA_3_2)
    plain = ModelConfig.from_hf_dict(dict(hub, rope_parameters={"rope_type": "default", "rope_theta": 1234.0}))
    assert plain.rope_scaling is None and plain.rope_theta == 1234.0


def test_what_transformers_writes():
    transformers = pytest.importorskip("transformers")
    hf = transformers.LlamaConfig(
        vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=8,
        num_key_value_heads=2, max_position_embeddings=16384, tie_word_embeddings=True, rms_norm_eps=1e-5,
        rope_scaling={"rope_type": "llama3", **LLAMA3_SCALING}, rope_theta=500000.0,
    )
    c = ModelConfig.from_hf_dict(json.loads(hf.to_json_string()))
    assert (c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (128, 8, 2, 16)
    assert c.rope_theta == 500000.0 and c.rope_scaling == {"rope_type": "llama3", **LLAMA3_SCALING}
    assert c.tie_word_embeddings and c.rms_norm_eps == 1e-5


def test_defaults():
    d = {"vocab_size": 100, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
         "num_attention_heads": 4, "eos_token_id": 7}
    c = ModelConfig.from_hf_dict(d)
    assert c.head_dim == 16 and c.num_key_value_heads == 4 and c.eos_token_ids == [7]
    assert c.rope_scaling is None and c.rope_theta == 10000.0 and not c.tie_word_embeddings
    assert c.torch_dtype == "float32" and c.bos_token_id is None


@pytest.mark.parametrize("archs", [["GemmaForCausalLM"], ["LlamaForCausalLM", "Qwen2ForCausalLM"], "Llama"])
def test_bad_architecture(archs):
    supported = "supported are LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM"
    with pytest.raises(ValueError, match=supported) as e:
        ModelConfig.from_hf_dict(dict(HUB_LLAMA_3_2, architectures=archs))
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="model_type 'llama' does not match Qwen2ForCausalLM"):
        ModelConfig.from_hf_dict(dict(HUB_LLAMA_3_2, architectures=["Qwen2ForCausalLM"]))


# The parts of Qwen2.5-0.5B-Instruct's, Qwen3-0.6B's and Mistral-7B-Instruct-v0.3's config.json that differ from Llama.
HUB_QWEN2_5 = dict(HUB_LLAMA_3_2, architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=896,
                   num_attention_heads=14, num_key_value_heads=2, rope_theta=1000000.0, rope_scaling=None,
                   use_sliding_window=False, sliding_window=32768, max_window_layers=21, head_dim=None)
HUB_QWEN3 = dict(HUB_LLAMA_3_2, architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=1024,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128, rope_theta=1000000.0, rope_scaling=None,
                 attention_bias=False, use_sliding_window=False, sliding_window=None)
HUB_MISTRAL = dict(HUB_LLAMA_3_2, architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=None,
                   max_position_embeddings=32768, rope_scaling=None)


def test_families():
    qwen2 = ModelConfig.from_hf_dict(HUB_QWEN2_5)
    assert qwen2.attention_bias and not qwen2.qk_norm and qwen2.head_dim == 64 and qwen2.sliding_window is None
    qwen3 = ModelConfig.from_hf_dict(HUB_QWEN3)
    assert qwen3.qk_norm and not qwen3.attention_bias and qwen3.head_dim * 16 != qwen3.hidden_size
    mistral = ModelConfig.from_hf_dict(HUB_MISTRAL)
    assert not (mistral.attention_bias or mistral.qk_norm) and mistral.architecture == "MistralForCausalLM"
    llama = ModelConfig.from_hf_dict(HUB_LLAMA_3_2)
    assert not (llama.attention_bias or llama.qk_norm)
    for c in (qwen2, qwen3, mistral):
        assert ModelConfig.from_hf_dict(json.loads(json.dumps(c.to_hf_dict()))) == c


def test_sliding_window_layers_run_on_cuda():
    qwen = ModelConfig.from_hf_dict(dict(HUB_QWEN2_5, use_sliding_window=True, sliding_window=4096,
                                         num_hidden_layers=28))
    assert qwen.layer_windows == [None] * 21 + [4096] * 7  # from max_window_layers on
    assert ModelConfig.from_hf_dict(HUB_QWEN2_5).layer_windows == [None] * 16  # a window it never turns on
    with pytest.raises(ValueError, match="attention_bias"):  # Qwen3's flag also biases O
        ModelConfig.from_hf_dict(dict(HUB_QWEN3, attention_bias=True))
    mistral = ModelConfig.from_hf_dict(dict(HUB_MISTRAL, sliding_window=4096))
    for length in (4096, 4097, None):  # the attention kernels take each layer's window
        check_cuda_kernels(mistral, length)
        check_cuda_kernels(qwen, length)


@pytest.mark.parametrize("kind", ["dynamic", "yarn"])
def test_unsupported_rope_type(kind):
    with pytest.raises(ValueError, match=kind):
        ModelConfig.from_hf_dict(dict(HUB_LLAMA_3_2, rope_scaling={"rope_type": kind, "factor": 2.0}))


@pytest.mark.parametrize("key, value", [("attention_bias", True), ("mlp_bias", True), ("hidden_act", "gelu")])
def test_unsupported_fields(key, value):
    with pytest.raises(ValueError, match=key):
        ModelConfig.from_hf_dict(dict(HUB_LLAMA_3_2, **{key: value}))


def test_missing_field_and_incomplete_llama3():
    d = dict(HUB_LLAMA_3_2)
    del d["intermediate_size"]
    with pytest.raises(ValueError, match="intermediate_size"):
        ModelConfig.from_hf_dict(d)
    with pytest.raises(ValueError, match="high_freq_factor"):
        ModelConfig.from_hf_dict(dict(HUB_LLAMA_3_2, rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                                                   "low_freq_factor": 1.0,
                                                                   "original_max_position_embeddings": 8192}))


def test_from_dir_merges_generation_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        ModelConfig.from_dir(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(dict(HUB_LLAMA_3_2, eos_token_id=128001)))
    assert ModelConfig.from_dir(tmp_path).eos_token_ids == [128001]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [128001, 128009]}))
    assert ModelConfig.from_dir(tmp_path).eos_token_ids == [128001, 128009]


@pytest.mark.parametrize("make", [tiny_config, llama_3_2_1b_config, smollm2_135m_config])
def test_to_hf_dict_round_trip(make):
    c = make()
    assert ModelConfig.from_hf_dict(json.loads(json.dumps(c.to_hf_dict()))) == c


def test_smollm2_shapes():
    c = smollm2_135m_config()
    assert c.num_attention_heads * c.head_dim == c.hidden_size == 576 and c.tie_word_embeddings
