"""FP8 W8A8 weights on the numpy backend (quantization="fp8"): the e4m3 quantizers against torch's float8_e4m3fn bit
for bit, the model against a torch fake-quant reference built here, the setting from the API, the CLI and job files,
a GGUF quantized at load, and the cuda backend's refusal."""

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from helpers import ok_run, require, run

from tinyvllm import LLM, SamplingParams
from tinyvllm.backends.host_weight import HostWeight, linear
from tinyvllm.cli import main
from tinyvllm.config import EngineConfig, SettingError
from tinyvllm.model.dtypes import E4M3_VALUES, f32_to_e4m3
from tinyvllm.model.dummy import random_weights, save_hf_model_dir, tiny_config
from tinyvllm.model.fp8 import Fp8Rows, expand_block_scale, quantize_activations, quantize_rows

torch = require("torch")
EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


# ---- torch's fake quantization: the reference -----------------------------------------------------------------------

def torch_scale(amax):
    return torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))


def fq_rows(w, block=None):
    """A weight [out, in] through e4m3 and back, one scale per row (or per `block` of it, given its scales)."""
    scale = torch_scale(w.abs().amax(dim=1, keepdim=True))
    return (w / scale).to(torch.float8_e4m3fn).float() * scale


def fq_tokens(x, group=None, input_scale=None):
    """Activations [..., in] through e4m3 and back: per token (last axis), per token and `group` columns, or static."""
    if input_scale is not None:
        return (x / input_scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * input_scale  # saturated
    if group is not None:
        g = x.reshape(*x.shape[:-1], -1, group)
        return fq_tokens(g).reshape(x.shape)
    scale = torch_scale(x.abs().amax(dim=-1, keepdim=True))
    return (x / scale).to(torch.float8_e4m3fn).float() * scale


class FakeQuantLinear(torch.nn.Module):
    """A linear layer of dequantized e4m3 weights whose input is quantized first."""

    def __init__(self, weight, bias, group=None, input_scale=None):
        super().__init__()
        self.weight, self.bias, self.group, self.input_scale = weight, bias, group, input_scale

    def forward(self, x):
        return torch.nn.functional.linear(fq_tokens(x, self.group, self.input_scale), self.weight, self.bias)


def hf_model(config, weights):
    """HF transformers' model (float32, eager attention) with these weights (HF names, numpy)."""
    transformers = require("transformers")
    hf_dict = config.to_hf_dict()
    hf_dict.pop("quantization_config", None)
    hf_config = transformers.AutoConfig.for_model(hf_dict.pop("model_type"), **hf_dict)
    hf_config._attn_implementation = "eager"
    model = getattr(transformers, config.architecture)(hf_config).eval()
    state = {name: torch.from_numpy(np.ascontiguousarray(weights[name], np.float32)) for name in weights}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all("lm_head" in m for m in missing), (missing, unexpected)
    return model


def fake_quantize(model, weight_of=None, group=None, input_scale=None, skip=()):
    """Every linear layer of the decoder layers (not the LM head) made a FakeQuantLinear: its weight fq_rows(W), or
    weight_of(name) (a checkpoint's dequantized weight); those named in `skip` (a checkpoint's ignore list) left as
    they are."""
    for name, module in list(model.model.layers.named_modules()):
        if isinstance(module, torch.nn.Linear) and f"model.layers.{name}" not in skip:
            full = f"model.layers.{name}.weight"
            w = fq_rows(module.weight.data) if weight_of is None else weight_of(full)
            scale = None if input_scale is None else input_scale(full)
            parent, _, child = name.rpartition(".")
            setattr(model.model.layers.get_submodule(parent), child, FakeQuantLinear(w, module.bias, group, scale))
    return model


def hf_logprobs(model, prompts):
    """Each prompt's logprob of its tokens 1.. (teacher-forced), concatenated."""
    out = []
    with torch.no_grad():
        for p in prompts:
            logits = model(torch.tensor([p])).logits[0].double()
            out.append(torch.log_softmax(logits, -1)[:-1].gather(1, torch.tensor(p[1:])[:, None])[:, 0].numpy())
    return np.concatenate(out)


def our_logprobs(llm, prompts):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=1, prompt_logprobs=0),
                        use_tqdm=False)
    return np.concatenate([[d[t].logprob for d, t in zip(o.prompt_logprobs[1:], p[1:])] for o, p in zip(outs, prompts)])


def torch_e4m3(x):
    return torch.from_numpy(np.ascontiguousarray(x, np.float32)).to(torch.float8_e4m3fn).view(torch.uint8).numpy()


# ---- the quantizers ----------------------------------------------------------------------------------------------

def test_e4m3_quantizer_is_torchs_bit_for_bit_with_saturation():
    """Random magnitudes over e4m3's whole range and past it, every code's value, every tie between neighbours (to
    the even code) and the subnormals' ties: the codes are torch's, where torch is given the value clamped to 448
    (torch makes NaN of what rounds past 448; the quantizer saturates, as the GPU's satfinite conversion does)."""
    rng = np.random.default_rng(1)
    x = (rng.standard_normal(400_000) * np.exp2(rng.uniform(-16, 12, 400_000))).astype(np.float32)
    values = np.sort(E4M3_VALUES[~np.isnan(E4M3_VALUES)].astype(np.float64))
    ties = ((values[:-1] + values[1:]) / 2).astype(np.float32)
    subnormal_ties = (np.arange(16) + 0.5).astype(np.float32) * np.float32(2.0**-9)
    for sample in (x, values.astype(np.float32), ties, subnormal_ties, -subnormal_ties, np.float32([0.0, -0.0])):
        np.testing.assert_array_equal(f32_to_e4m3(sample), torch_e4m3(np.clip(sample, -448, 448)))
    assert (f32_to_e4m3(x[np.abs(x) > 464]) & 0x7F == 126).all()  # past 448: saturated, never NaN


def test_weight_and_activation_quantizers_are_torchs_fake_quant():
    rng = np.random.default_rng(2)
    w = rng.standard_normal((96, 80)).astype(np.float32) * np.exp2(rng.uniform(-8, 4, (96, 1))).astype(np.float32)
    w[5] = 0  # an all-zero row: scale 1, codes 0
    rows = quantize_rows(w)
    np.testing.assert_array_equal(rows.scale, torch_scale(torch.from_numpy(w).abs().amax(1)).numpy())
    np.testing.assert_array_equal(rows.dequantize(), fq_rows(torch.from_numpy(w)).numpy())
    assert (rows.codes[5] == 0).all() and np.abs(rows.codes.astype(int) & 0x7F).max() == 126  # each row reaches 448
    x = rng.standard_normal((7, 256)).astype(np.float32) * 30
    x[3] = 0
    xt = torch.from_numpy(x)
    np.testing.assert_array_equal(quantize_activations(x), fq_tokens(xt).numpy())
    np.testing.assert_array_equal(quantize_activations(x, group=128), fq_tokens(xt, group=128).numpy())
    np.testing.assert_array_equal(quantize_activations(x, input_scale=0.25), fq_tokens(xt, input_scale=0.25).numpy())
    assert not np.array_equal(quantize_activations(x), x)


@pytest.mark.parametrize("kind", ["channel", "block", "static"])
def test_fp8_linear_is_the_product_of_the_fake_quantized_values(kind):
    """Per-channel weights with per-token activations; 128 x 128 block scales (partial blocks at the edges) with
    per-token 128-column groups; a static input scale."""
    rng = np.random.default_rng(3)
    w, x = rng.standard_normal((200, 300)).astype(np.float32), rng.standard_normal((5, 300)).astype(np.float32)
    wt, xt = torch.from_numpy(w), torch.from_numpy(x)
    if kind == "block":
        scale = np.float32(rng.uniform(0.5, 2, (2, 3)) / 448 * 4)
        rows = Fp8Rows(f32_to_e4m3(w / expand_block_scale(scale, (128, 128), w.shape)), scale, (128, 128))
        want = fq_tokens(torch.nn.functional.pad(xt, (0, 84)), group=128)[:, :300] @ torch.from_numpy(
            rows.dequantize()).T
    else:
        rows = replace(quantize_rows(w), input_scale=0.01 if kind == "static" else None)
        want = fq_tokens(xt, input_scale=rows.input_scale) @ fq_rows(wt).T
    weight = HostWeight.from_fp8(rows)
    assert weight.dtype == "float8_e4m3fn" and weight.data.dtype == np.uint8 and weight.shape == (300, 200)
    np.testing.assert_allclose(linear(x, weight), want.numpy(), rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    assert np.abs(linear(x, weight) - x @ w.T).max() > 1e-3  # the quantization is there
    with pytest.raises(ValueError, match="weight scale of shape"):
        HostWeight(weight.data, "float8_e4m3fn", np.ones(3, np.float32))


# ---- the model ---------------------------------------------------------------------------------------------------

FAMILIES = {"llama": {}, "qwen2": {"architecture": "Qwen2ForCausalLM"},
            "qwen3": {"architecture": "Qwen3ForCausalLM", "tie_word_embeddings": True}}


@pytest.mark.parametrize("family", FAMILIES)
def test_numpy_w8a8_equals_a_torch_fake_quant_model(family, tmp_path):
    """Teacher-forced logprobs of the numpy backend with quantization="fp8" are HF's model with every decoder
    linear layer fake-quantized (weights per channel, activations per token), up to float32 summation order: where
    that order moves an activation across an e4m3 rounding boundary (about one element in 10^6) the codes differ by
    one step, and attention carries that to the later positions, so the two agree to well within the quantization's
    own error, not exactly."""
    config = tiny_config(**FAMILIES[family])
    weights = random_weights(config, seed=4)
    path = save_hf_model_dir(tmp_path, config, weights)
    prompts = [np.random.default_rng(i).integers(3, config.vocab_size, 40).tolist() for i in range(3)]
    ours = our_logprobs(LLM(path, backend="numpy", quantization="fp8", max_model_len=128), prompts)
    reference = hf_logprobs(fake_quantize(hf_model(config, weights)), prompts)
    unquantized = hf_logprobs(hf_model(config, weights), prompts)
    error, quantization = np.abs(ours - reference), np.abs(unquantized - reference).mean()
    assert error.mean() < quantization / 5, (error.mean(), quantization)
    assert quantization > 1e-3


@pytest.mark.parametrize("family", ["llama", "qwen3"])  # an untied LM head, and a tied one
def test_quantize_lm_head_equals_a_torch_fake_quant_model(family, tmp_path):
    """quantize_lm_head: the LM head through e4m3 too (a scale per vocabulary row, its input per token), the
    embedding not (a tied one's lookup reads the unquantized rows): the reference is the fake-quant model above
    with its LM head a FakeQuantLinear as well; without the head's quantization the error is larger."""
    config = tiny_config(**FAMILIES[family])
    weights = random_weights(config, seed=6)
    path = save_hf_model_dir(tmp_path, config, weights)
    prompts = [np.random.default_rng(20 + i).integers(3, config.vocab_size, 40).tolist() for i in range(3)]
    llm = LLM(path, backend="numpy", quantization="fp8", quantize_lm_head=True, max_model_len=128)
    backend = llm.llm_engine.backend
    assert backend.lm_head.dtype == "float8_e4m3fn" and backend.embed.dtype == np.float32
    assert backend.lm_head.scale.shape == (config.vocab_size,)
    ours = our_logprobs(llm, prompts)
    model = fake_quantize(hf_model(config, weights))
    layers_only = hf_logprobs(model, prompts)
    model.lm_head = FakeQuantLinear(fq_rows(model.lm_head.weight.data), None)
    reference = hf_logprobs(model, prompts)
    error, head_effect = np.abs(ours - reference).mean(), np.abs(layers_only - reference).mean()
    assert error < head_effect / 5, (error, head_effect)
    assert head_effect > 1e-4


def test_quantize_lm_head_needs_fp8_weights_and_comes_from_the_cli_and_job_files(tiny_model_dir, tmp_path):
    assert EngineConfig().quantize_lm_head is False
    with pytest.raises(SettingError, match="^invalid quantize_lm_head=True: the LM head is quantized only with FP8 "
                                           "weights"):
        LLM(tiny_model_dir, backend="numpy", quantize_lm_head=True)
    prompts = EXAMPLES / "prompts.jsonl"
    ok_run(tiny_model_dir, prompts, tmp_path / "o.parquet", "--max-tokens", 2, "--quantization", "fp8",
           "--quantize-lm-head")
    assert engine_of(tmp_path / "o.parquet")["quantize_lm_head"] is True
    bad = run(tiny_model_dir, prompts, tmp_path / "b.parquet", "--max-tokens", 2, "--quantize-lm-head")
    assert bad.exit_code != 0 and "invalid quantize_lm_head=True" in bad.stderr and "Traceback" not in bad.stderr
    job = tmp_path / "job.toml"
    job.write_text(f'input = "{prompts}"\noutput = "{tmp_path / "j.parquet"}"\nmodel = "{tiny_model_dir}"\n'
                   'backend = "numpy"\nquantization = "fp8"\nquantize_lm_head = true\n[sampling]\nmax_tokens = 2\n')
    assert CliRunner().invoke(main, ["job", str(job), "--quiet"]).exit_code == 0
    assert engine_of(tmp_path / "j.parquet")["quantize_lm_head"] is True
    job.write_text(job.read_text().replace("quantize_lm_head = true", 'quantize_lm_head = "yes"'))
    bad_job = CliRunner().invoke(main, ["job", str(job), "--quiet"])
    assert bad_job.exit_code != 0 and "quantize_lm_head" in bad_job.output and "Traceback" not in bad_job.output


def test_quantization_keeps_the_embedding_and_lm_head_float32(tiny_model_dir):
    backend = LLM(tiny_model_dir, backend="numpy", quantization="fp8", max_model_len=64).llm_engine.backend
    layer = backend.layers[0]
    assert {w.dtype for w in (layer.qkv, layer.o, layer.gate_up, layer.down)} == {"float8_e4m3fn"}
    assert backend.lm_head.dtype == "float32" and backend.embed.dtype == np.float32
    assert layer.qkv.scale.shape == (layer.qkv.shape[1],)


def test_a_gguf_is_quantized_at_load(tmp_path):
    from test_gguf import write_gguf

    config = tiny_config()
    weights = random_weights(config, seed=5)
    path = tmp_path / "m.gguf"
    write_gguf(path, config, weights)
    prompts = [np.random.default_rng(9).integers(3, config.vocab_size, 32).tolist()]
    llm = LLM(path, backend="numpy", quantization="fp8", max_model_len=64)
    assert llm.llm_engine.backend.layers[1].down.dtype == "float8_e4m3fn"
    reference = hf_logprobs(fake_quantize(hf_model(config, weights)), prompts)
    unquantized = hf_logprobs(hf_model(config, weights), prompts)
    assert np.abs(our_logprobs(llm, prompts) - reference).mean() < np.abs(unquantized - reference).mean() / 5


# ---- the setting -------------------------------------------------------------------------------------------------

def engine_of(output: Path) -> dict:
    return json.loads(pq.read_schema(output).metadata[b"tinyvllm.engine"])


def test_quantization_from_the_api_cli_and_job_files(tiny_model_dir, tmp_path):
    assert EngineConfig().quantization is None and EngineConfig(quantization="fp8").quantization == "fp8"
    with pytest.raises(SettingError, match="^invalid quantization='awq': choose fp8$"):
        LLM(tiny_model_dir, backend="numpy", quantization="awq")
    prompts = EXAMPLES / "prompts.jsonl"
    ok_run(tiny_model_dir, prompts, tmp_path / "o.parquet", "--max-tokens", 2, "--quantization", "fp8")
    assert engine_of(tmp_path / "o.parquet")["quantization"] == "fp8"
    bad = run(tiny_model_dir, prompts, tmp_path / "b.parquet", "--quantization", "int8")
    assert bad.exit_code == 2 and "Invalid value for '--quantization'" in bad.stderr
    job = tmp_path / "job.toml"
    job.write_text(f'input = "{prompts}"\noutput = "{tmp_path / "j.parquet"}"\nmodel = "{tiny_model_dir}"\n'
                   'backend = "numpy"\nquantization = "fp8"\n[sampling]\nmax_tokens = 2\n')
    assert CliRunner().invoke(main, ["job", str(job), "--quiet"]).exit_code == 0
    assert engine_of(tmp_path / "j.parquet")["quantization"] == "fp8"
