"""GGUF files of the gemma2, gemma3 and phi3 architectures, as convert_hf_to_gguf writes them (Gemma's norm gains
with their +1, Phi-3's LongRoPE factors as tensors, partial rotary as rope.dimension_count), give the config and
weights of the same HF directory."""

import gguf
import numpy as np
import pytest
from helpers import llm_for
from test_family_gemma import GEMMA2, GEMMA3
from test_family_phi3 import PHI, longrope
from test_gguf import add_dummy_tokenizer, gguf_writer

from tinyvllm import SamplingParams, TokensPrompt
from tinyvllm.model.dummy import random_weights, save_hf_model_dir, tiny_config
from tinyvllm.model.loader import load_model, weight_shapes

ARCHS = {"Gemma2ForCausalLM": gguf.MODEL_ARCH.GEMMA2, "Gemma3ForCausalLM": gguf.MODEL_ARCH.GEMMA3,
         "Phi3ForCausalLM": gguf.MODEL_ARCH.PHI3}


def write_family_gguf(path, config, weights):
    arch = ARCHS[config.architecture]
    w = gguf_writer(path, gguf.MODEL_ARCH_NAMES[arch], config, config.rotary_dim)
    w.add_key_length(config.head_dim)
    if config.sliding_window:
        w.add_sliding_window(config.sliding_window)
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(config, key):
            getattr(w, f"add_{key}")(getattr(config, key))
    scaling = config.rope_scaling or {}
    if scaling.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(scaling["factor"])
    if scaling.get("rope_type") == "longrope":
        w.add_rope_scaling_orig_ctx_len(scaling["original_max_position_embeddings"])
        w.add_tensor("rope_factors_long.weight", np.array(scaling["long_factor"], np.float32))
        w.add_tensor("rope_factors_short.weight", np.array(scaling["short_factor"], np.float32))
    add_dummy_tokenizer(w, config.vocab_size)
    w.add_bos_token_id(config.bos_token_id)
    w.add_eos_token_id(config.eos_token_ids[0])
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    for hf, arr in weights.items():
        if hf == "lm_head.weight" and config.tie_word_embeddings:
            continue
        if config.norm_offset and hf.endswith("norm.weight"):
            arr = arr + np.float32(1)  # convert_hf_to_gguf's Gemma norm shift
        w.add_tensor(names.get_name(hf, try_suffixes=(".weight", ".bias")), arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


SLIDE, FULL = "sliding_attention", "full_attention"
CASES = {"gemma2": GEMMA2,  # llama.cpp's layer patterns: gemma2's every other layer, gemma3's 5 of 6
         "gemma3": dict(GEMMA3, num_hidden_layers=6, layer_types=(SLIDE,) * 5 + (FULL,)),
         "phi4-mini": dict(PHI, tie_word_embeddings=True, partial_rotary_factor=0.75, rope_scaling=longrope(6, 32),
                           max_position_embeddings=256, sliding_window=200)}


@pytest.mark.parametrize("case", list(CASES))
def test_family_gguf_loads_as_the_hf_dir(tmp_path, case):
    config = tiny_config(**CASES[case])
    if config.norm_offset:  # llama.cpp assumes Gemma's query_pre_attn_scalar: head_dim (but in the 27B)
        config = tiny_config(**CASES[case] | {"query_pre_attn_scalar": config.head_dim})
    weights = random_weights(config, seed=7)
    hf = load_model(save_hf_model_dir(tmp_path / "hf", config, weights))
    m = load_model(write_family_gguf(tmp_path / "m.gguf", config, weights))
    assert m.config == hf.config
    assert set(m.weights) == set(hf.weights) == set(weight_shapes(config))
    for name, w in hf.weights.items():
        np.testing.assert_allclose(m.weights[name], w, rtol=0, atol=1e-6, err_msg=name)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    runs = []
    for model in (tmp_path / "hf", tmp_path / "m.gguf"):
        with llm_for(model, block_size=4, max_model_len=64) as llm:
            outputs = llm.generate([TokensPrompt(prompt_token_ids=[5, 80, 300, 7, 9, 41, 2, 77])], params)
            runs.append([o.outputs[0].token_ids for o in outputs])
    assert runs[0] == runs[1]
