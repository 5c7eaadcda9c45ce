"""FP8 checkpoints on the numpy backend: HF quant_method fp8 (per-tensor weight_scale / weight_scale_inv, 128 x 128
block weight_scale_inv) and compressed-tensors float8 W8A8 (per-channel or per-tensor weight_scale, optional static
input_scale), written here as tiny safetensors files with torch's float8_e4m3fn, loaded as stored and run against a
torch fake-quant model of the same codes; and the checkpoints refused, in one line."""

import json
from dataclasses import replace

import numpy as np
import pytest
from click.testing import CliRunner
from helpers import one_line_error, require
from test_fp8_weights import EXAMPLES, fake_quantize, hf_logprobs, hf_model, our_logprobs

from tinyvllm import LLM
from tinyvllm.cli import main
from tinyvllm.config import SettingError
from tinyvllm.model.dummy import random_weights, save_hf_model_dir, tiny_config
from tinyvllm.model.layout import router_weights
from tinyvllm.model.loader import load_model

torch = require("torch")
safetensors_torch = require("safetensors.torch")

BLOCK_CONFIG = dict(hidden_size=256, intermediate_size=384, num_attention_heads=4, num_key_value_heads=2, head_dim=64)
FP8 = "float8_e4m3fn"


def quantize(w, scale_shape):
    """A weight [out, in] (torch) -> (float8 codes, float32 scales of `scale_shape`: per tensor, per row or per
    128 x 128 block), each scale amax / 448 of what it covers."""
    out, n_in = w.shape
    if scale_shape == "block":
        rows, cols = -(-out // 128), -(-n_in // 128)
        padded = torch.nn.functional.pad(w.abs(), (0, cols * 128 - n_in, 0, rows * 128 - out))
        scale = padded.reshape(rows, 128, cols, 128).amax(dim=(1, 3)) / 448
        full = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:out, :n_in]
    else:
        scale = w.abs().amax(dim=1, keepdim=True) / 448 if scale_shape == "row" else w.abs().amax().reshape(1) / 448
        full = scale if scale_shape == "row" else scale.reshape(1, 1)
    return (w / full).to(torch.float8_e4m3fn), scale


def dequantized(codes, scale, blocks: bool):
    out, n_in = codes.shape
    if blocks:
        scale = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:out, :n_in]
    return codes.float() * (scale if scale.dim() == 2 else scale.reshape(1, 1))


# name -> (quantization_config, scale shape, weight scale's name, static input scale or None, group of activations)
SCHEMES = {
    "fp8-tensor": ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "tensor", "weight_scale", None, None),
    "fp8-tensor-inv": ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "tensor", "weight_scale_inv", None,
                       None),
    "fp8-static": ({"quant_method": "fp8", "activation_scheme": "static"}, "tensor", "weight_scale", 0.02, None),
    "fp8-block": ({"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                   "weight_block_size": [128, 128]}, "block", "weight_scale_inv", None, 128),
    "ct-channel": ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "dynamic": False},
        "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}}},
        "ignore": ["lm_head", "model.layers.1.mlp.down_proj"]}, "row", "weight_scale", None, None),
    "ct-static": ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False},
        "input_activations": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}}},
        "ignore": ["lm_head"]}, "tensor", "weight_scale", 0.03, None),
}


UNIT_KV_SCALES = {"self_attn.k_proj.k_scale": 1.0, "self_attn.v_proj.v_scale": 1.0}  # ModelOpt's names


def write_fp8_checkpoint(path, scheme: str, seed: int = 6, kv_scales=UNIT_KV_SCALES, **config):
    """A tiny FP8 checkpoint of `scheme` (its ignored layer left float32; `kv_scales`: KV cache scales beside it,
    layer-prefix suffix -> a value for every layer, or a list of one per layer (each a number or one per KV head))
    -> (its dir, its config, the dequantized weights, the static input scale or None, the activation group)."""
    quant, scale_shape, scale_name, input_scale, group = SCHEMES[scheme]
    cfg = tiny_config(**{**(BLOCK_CONFIG if scale_shape == "block" else {}), **config})
    weights = random_weights(cfg, seed)
    save_hf_model_dir(path, cfg, weights)
    tensors, reference, routers = {}, dict(weights), set(router_weights(cfg))  # routers stay float, as vLLM's do
    for name, w in weights.items():
        w = torch.from_numpy(w)
        if (w.dim() != 2 or not name.startswith("model.layers.") or name in routers
                or name.removesuffix(".weight") in quant.get("ignore", [])):
            tensors[name] = w.clone()  # a tied LM head is the embedding's array: safetensors wants it a copy
            continue
        codes, scale = quantize(w, scale_shape)
        tensors[name], tensors[name.removesuffix("weight") + scale_name] = codes, scale
        if input_scale is not None:
            tensors[name.removesuffix("weight") + "input_scale"] = torch.tensor([input_scale])
        reference[name] = dequantized(codes, scale, scale_shape == "block").numpy()
    for suffix, values in kv_scales.items():
        for i in range(cfg.num_hidden_layers):
            value = values[i] if isinstance(values, list) else values
            if value is not None:
                tensors[f"model.layers.{i}.{suffix}"] = torch.tensor(value, dtype=torch.float32)
    safetensors_torch.save_file(tensors, str(path / "model.safetensors"))
    config_json = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config_json, "quantization_config": quant}))
    return path, cfg, reference, input_scale, group


@pytest.mark.parametrize("scheme", SCHEMES)
def test_an_fp8_checkpoint_runs_as_a_torch_fake_quant_of_its_codes(scheme, tmp_path):
    path, cfg, reference_weights, input_scale, group = write_fp8_checkpoint(tmp_path, scheme)
    model = load_model(path)
    assert model.config.quantization is not None and model.config.quantization.method == SCHEMES[scheme][0][
        "quant_method"]
    llm = LLM(model, backend="numpy", max_model_len=128)
    layer = llm.llm_engine.backend.layers[0]
    assert layer.qkv.dtype == FP8 and (layer.qkv.block is not None) == (group is not None)
    file_codes = safetensors_torch.load_file(str(path / "model.safetensors"))["model.layers.0.self_attn.k_proj.weight"]
    k_rows = slice(cfg.num_attention_heads * cfg.head_dim, (cfg.num_attention_heads + cfg.num_key_value_heads)
                   * cfg.head_dim)
    np.testing.assert_array_equal(layer.qkv.data[:, k_rows].T, file_codes.view(torch.uint8).numpy())  # as stored
    if scheme == "ct-channel":
        assert llm.llm_engine.backend.layers[1].down.dtype == "float32"  # the ignored layer
    prompts = [np.random.default_rng(i).integers(3, cfg.vocab_size, 40).tolist() for i in range(3)]
    ours = our_logprobs(llm, prompts)
    hf = fake_quantize(hf_model(cfg, reference_weights), weight_of=lambda name: torch.from_numpy(
        reference_weights[name]), group=group, input_scale=None if input_scale is None else lambda _: input_scale,
        skip=SCHEMES[scheme][0].get("ignore", ()))
    reference = hf_logprobs(hf, prompts)
    unquantized = hf_logprobs(hf_model(cfg, random_weights(cfg, 6)), prompts)
    error, quantization = np.abs(ours - reference), np.abs(unquantized - reference).mean()
    assert error.mean() < quantization / 5, (error.mean(), quantization)
    # the dequantized weights are what any other reader of the checkpoint gets
    np.testing.assert_array_equal(model.weights["model.layers.0.mlp.up_proj.weight"],
                                  reference_weights["model.layers.0.mlp.up_proj.weight"])
    assert not any(name.endswith(("_scale", "_scale_inv")) for name in model.weights)


def test_quantization_fp8_on_an_fp8_checkpoint_runs_it_as_stored(tmp_path):
    path, *_ = write_fp8_checkpoint(tmp_path, "fp8-tensor")
    prompts = [np.random.default_rng(0).integers(3, 500, 24).tolist()]
    a = our_logprobs(LLM(path, backend="numpy", max_model_len=64), prompts)
    b = our_logprobs(LLM(path, backend="numpy", quantization="fp8", max_model_len=64), prompts)
    np.testing.assert_array_equal(a, b)


def test_an_fp8_checkpoint_with_the_fp8_kv_cache(tmp_path):
    """The cache's scales come from the dequantized weights. Its error over the W8A8 model alone, measured 0.083 here
    (a random model's flat logits amplify it; tests/test_fp8_kv.py has 0.038 on a float one); a scale misread from
    the codes rather than their values moves logprobs by nats."""
    path, cfg, *_ = write_fp8_checkpoint(tmp_path, "ct-channel")
    prompts = [np.random.default_rng(i).integers(3, cfg.vocab_size, 32).tolist() for i in range(3)]
    llm = LLM(path, backend="numpy", kv_cache_dtype="fp8", max_model_len=64)
    assert llm.llm_engine.backend.k_cache[0].dtype == np.uint8
    error = np.abs(our_logprobs(llm, prompts) - our_logprobs(LLM(path, backend="numpy", max_model_len=64), prompts))
    assert 0 < error.mean() < 0.15, error.mean()


def test_a_fused_projection_not_a_multiple_of_the_block_is_refused(tmp_path):
    path, *_ = write_fp8_checkpoint(tmp_path, "fp8-block", head_dim=32, num_attention_heads=8, num_key_value_heads=1)
    with pytest.raises(ValueError, match="must have a multiple of the weight block's 128 rows"):
        LLM(path, backend="numpy", max_model_len=64)


@pytest.mark.parametrize("method", ["awq", "gptq", "bitsandbytes"])
def test_a_checkpoint_quantized_another_way_is_refused_naming_its_method(method, tiny_model_dir, tmp_path):
    model = tmp_path / "m"
    save_hf_model_dir(model, tiny_config(), random_weights(tiny_config()))
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": method,
                                                                                      "bits": 4}}))
    with pytest.raises(ValueError, match=f"unsupported quantization_config quant_method '{method}'"):
        load_model(model)
    result = CliRunner().invoke(main, ["run", "--input", str(EXAMPLES / "prompts.jsonl"), "--output",
                                       str(tmp_path / "o.parquet"), "--model", str(model), "--backend", "numpy",
                                       "--quiet"])
    one_line_error(result, f"unsupported quantization_config quant_method '{method}'")


@pytest.mark.parametrize("change, message", [
    (lambda q: q["config_groups"]["group_0"]["weights"].update(type="int"),
     "unsupported compressed-tensors scheme: int 8-bit weights"),
    (lambda q: q["config_groups"]["group_0"].pop("input_activations"),
     "unsupported compressed-tensors scheme: no input_activations"),
    (lambda q: q["config_groups"]["group_0"]["weights"].update(strategy="group"),
     "unsupported compressed-tensors weight strategy 'group'"),
])
def test_compressed_tensors_other_than_float8_w8a8_are_refused(change, message, tmp_path):
    path, *_ = write_fp8_checkpoint(tmp_path, "ct-channel")
    config = json.loads((path / "config.json").read_text())
    change(config["quantization_config"])
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        load_model(path)


def test_broken_fp8_checkpoints_are_refused_in_one_line(tmp_path):
    path, *_ = write_fp8_checkpoint(tmp_path / "a", "fp8-tensor")
    tensors = safetensors_torch.load_file(str(path / "model.safetensors"))
    scale = tensors.pop("model.layers.0.mlp.down_proj.weight_scale")
    safetensors_torch.save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match="float8 tensor model.layers.0.mlp.down_proj.weight has no "
                                         "model.layers.0.mlp.down_proj.weight_scale or"):
        load_model(path)
    tensors["model.layers.0.mlp.down_proj.weight_scale"] = torch.ones(3) * scale
    safetensors_torch.save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"weight_scale has shape \(3,\), expected 1 or 64 values"):
        load_model(path)
    config = json.loads((path / "config.json").read_text())
    del config["quantization_config"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="is float8 but config.json has no quantization_config"):
        load_model(path)


@pytest.mark.parametrize("scheme", ["fp8-static", "ct-static"])
def test_the_cuda_backend_refuses_static_activation_scales(scheme, tmp_path):
    path, *_ = write_fp8_checkpoint(tmp_path, scheme)
    with pytest.raises(SettingError, match="is an FP8 checkpoint with static activation scales .*: the cuda backend "
                                           "quantizes activations per token; use backend numpy$"):
        LLM(path, backend="cuda")


def test_the_config_keeps_its_quantization_config(tmp_path):
    path, cfg, *_ = write_fp8_checkpoint(tmp_path, "fp8-block")
    config = load_model(path).config
    assert config.quantization.block == (128, 128) and not config.quantization.static_input
    assert config.to_hf_dict()["quantization_config"] == SCHEMES["fp8-block"][0]
    assert replace(config, quantization=None).to_hf_dict().get("quantization_config") is None



# ---- the checkpoint's KV cache scales ---------------------------------------------------------------------------------

@pytest.mark.parametrize("names", [("self_attn.k_scale", "self_attn.v_scale"),  # compressed-tensors
                                   ("self_attn.k_proj.k_scale", "self_attn.v_proj.v_scale"),  # ModelOpt
                                   ("self_attn.kv_scale",)])  # deprecated: one for K and V
def test_the_checkpoints_kv_cache_scales_are_the_fp8_caches(names, tmp_path):
    k, v = [0.037, 0.052], [0.011, 0.0625]
    values = dict(zip(names, (k, v))) if len(names) == 2 else {names[0]: k}
    path, cfg, *_ = write_fp8_checkpoint(tmp_path, "ct-channel", kv_scales=values)
    model = load_model(path)
    want_v = v if len(names) == 2 else k
    np.testing.assert_array_equal(model.kv_cache_scales[0], np.float32(k)[:, None].repeat(cfg.num_key_value_heads, 1))
    np.testing.assert_array_equal(model.kv_cache_scales[1], np.float32(want_v)[:, None].repeat(cfg.num_key_value_heads,
                                                                                              1))
    backend = LLM(model, backend="numpy", kv_cache_dtype="fp8", max_model_len=64).llm_engine.backend
    for i in range(cfg.num_hidden_layers):
        assert [float(s[0]) for s in backend.kv_scales[i]] == [np.float32(k[i]), np.float32(want_v[i])]
    assert not any("k_scale" in name or "kv_scale" in name for name in model.weights)


def test_checkpoint_scales_equal_to_the_caches_own_give_its_exact_outputs(tmp_path):
    """Per-KV-head scales equal to the ones the cache derives from the weights: the same codes, bitwise the same
    logprobs; a hundredth of them saturates the cache (its codes reach 448) and moves them."""
    from tinyvllm.model.kv_scales import kv_cache_scales

    base, cfg, *_ = write_fp8_checkpoint(tmp_path / "base", "ct-channel", kv_scales={})
    assert load_model(base).kv_cache_scales is None
    k, v = kv_cache_scales(load_model(base).weights, cfg)
    prompts = [np.random.default_rng(i).integers(3, cfg.vocab_size, 32).tolist() for i in range(2)]
    results = []
    for name, (ks, vs) in {"base": (None, None), "same": (k, v), "tiny": (k / 100, v / 100)}.items():
        path = base if ks is None else write_fp8_checkpoint(tmp_path / name, "ct-channel", kv_scales={
            "self_attn.k_scale": [row.tolist() for row in ks], "self_attn.v_scale": [row.tolist() for row in vs]})[0]
        llm = LLM(path, backend="numpy", kv_cache_dtype="fp8", max_model_len=64)
        results.append(our_logprobs(llm, prompts))
        codes = llm.llm_engine.backend.k_cache[0]
    np.testing.assert_array_equal(results[0], results[1])
    assert np.abs(results[2] - results[0]).mean() > 0.05
    assert (codes & 0x7F == 0x7E).any()  # the tiny scales' last cache: saturated entries (e4m3 448)


@pytest.mark.parametrize("kv_scales,message", [
    ({"self_attn.k_scale": [0.05, None], "self_attn.v_scale": 0.05}, "for some layers only: no K scale for layer 1"),
    ({"self_attn.k_scale": 0.0, "self_attn.v_scale": 0.05}, "model.layers.0.self_attn.k_scale is not a positive "
                                                            "finite scale"),
    ({"self_attn.k_scale": [[0.1, 0.2, 0.3]] * 2, "self_attn.v_scale": 0.05}, "has 3 values: a KV cache scale has 1 "
                                                                              "or 2"),
    ({"self_attn.k_scale": 0.05, "self_attn.kv_scale": 0.06}, "layer 0's K cache scale is given twice, with two "
                                                              "values"),
    ({"self_attn.attn.k_scale": 0.05}, "unexpected tensor model.layers.0.self_attn.attn.k_scale"),
])
def test_broken_kv_cache_scales_are_refused_in_one_line(kv_scales, message, tmp_path):
    path, *_ = write_fp8_checkpoint(tmp_path, "ct-channel", kv_scales=kv_scales)
    with pytest.raises(ValueError, match=message) as error:
        load_model(path)
    assert "\n" not in str(error.value)
