import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tinyvllm.model.dtypes import bf16_to_f32, f32_to_bf16
from tinyvllm.model.dummy import random_weights, save_hf_model_dir, tiny_config
from tinyvllm.model import loader
from tinyvllm.model.loader import as_bf16, load_model, read_safetensors, weight_shapes, write_safetensors
from tinyvllm.model.weights import pack_weights


def test_round_trip_float32_exact(tiny_model_dir):
    m = load_model(tiny_model_dir)
    expected = random_weights(tiny_config())
    assert m.config == tiny_config() and m.source == str(tiny_model_dir)
    assert set(m.weights) == set(weight_shapes(m.config)) == set(expected)
    for name, w in expected.items():
        assert m.weights[name].dtype == np.float32
        np.testing.assert_array_equal(m.weights[name], w, err_msg=name)
    assert m.tokenizer.decode(m.tokenizer.encode("hello world")) == "hello world"


def test_round_trip_bfloat16(make_model_dir):
    m = load_model(make_model_dir(dtype="bfloat16"))
    assert m.config.torch_dtype == "bfloat16"
    for name, w in random_weights(tiny_config()).items():
        got = m.weights[name]
        assert got.dtype == np.float32
        np.testing.assert_allclose(got, w, rtol=2**-8, atol=0, err_msg=name)  # bf16 keeps 8 significant bits
        np.testing.assert_array_equal(got, bf16_to_f32(f32_to_bf16(w)), err_msg=name)


def test_bf16_rounding_matches_torch():
    torch = pytest.importorskip("torch")
    x = np.random.default_rng(0).standard_normal(10_000, dtype=np.float32) * 100
    np.testing.assert_array_equal(bf16_to_f32(f32_to_bf16(x)), torch.from_numpy(x).bfloat16().float().numpy())


def test_round_trip_float16(make_model_dir):
    m = load_model(make_model_dir(dtype="float16", seed=3))
    assert m.config.torch_dtype == "float16"
    for name, w in random_weights(tiny_config(), seed=3).items():
        np.testing.assert_array_equal(m.weights[name], w.astype(np.float16).astype(np.float32), err_msg=name)


def test_bf16_helpers():
    x = np.array([1.0, -2.5, 3.140625, 1 + 2**-9, 1 + 3 * 2**-9, 1e-30, 65504.0], dtype=np.float32)
    back = bf16_to_f32(f32_to_bf16(x))
    np.testing.assert_array_equal(back, [1.0, -2.5, 3.140625, 1.0, 1 + 2**-7, back[5], 65536.0])
    assert abs(back[5] - 1e-30) / 1e-30 < 2**-8


def test_safetensors_files_are_standard(tmp_path):
    st_numpy = pytest.importorskip("safetensors.numpy")
    rng = np.random.default_rng(0)
    tensors = {"a": rng.standard_normal((3, 5), dtype=np.float32), "b": rng.standard_normal(7, dtype=np.float32)}
    for dtype, np_dtype in (("float32", np.float32), ("float16", np.float16)):
        write_safetensors(tmp_path / f"{dtype}.safetensors", tensors, dtype)
        theirs = st_numpy.load_file(str(tmp_path / f"{dtype}.safetensors"))
        for k, v in tensors.items():
            np.testing.assert_array_equal(theirs[k], v.astype(np_dtype))
    st_numpy.save_file({k: v.astype(np.float16) for k, v in tensors.items()}, str(tmp_path / "theirs.safetensors"))
    ours = read_safetensors(tmp_path / "theirs.safetensors")
    for k, v in tensors.items():
        np.testing.assert_array_equal(ours[k], v.astype(np.float16).astype(np.float32))


def test_bfloat16_files_written_by_torch(tmp_path):
    torch = pytest.importorskip("torch")
    st_torch = pytest.importorskip("safetensors.torch")
    t = torch.randn(4, 6).bfloat16()
    st_torch.save_file({"w": t}, str(tmp_path / "t.safetensors"))
    np.testing.assert_array_equal(read_safetensors(tmp_path / "t.safetensors")["w"], t.float().numpy())
    write_safetensors(tmp_path / "ours.safetensors", {"w": t.float().numpy()}, "bfloat16")
    assert torch.equal(st_torch.load_file(str(tmp_path / "ours.safetensors"))["w"], t)


def test_sharded(make_model_dir):
    path = make_model_dir(shards=3, seed=5)
    assert not (path / "model.safetensors").exists()
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 3
    m = load_model(path)
    for name, w in random_weights(tiny_config(), seed=5).items():
        np.testing.assert_array_equal(m.weights[name], w, err_msg=name)


def test_tied_and_untied(make_model_dir):
    tied = load_model(make_model_dir(tie_word_embeddings=True))
    assert tied.weights.entries["lm_head.weight"] is tied.weights.entries["model.embed_tokens.weight"]
    np.testing.assert_array_equal(tied.weights["lm_head.weight"], tied.weights["model.embed_tokens.weight"])
    assert "lm_head.weight" not in read_safetensors(tied.source + "/model.safetensors")
    untied = load_model(make_model_dir(tie_word_embeddings=False))
    assert not np.array_equal(untied.weights["lm_head.weight"], untied.weights["model.embed_tokens.weight"])


def _rewrite(path, edit):
    tensors = read_safetensors(path / "model.safetensors")
    edit(tensors)
    write_safetensors(path / "model.safetensors", tensors)


def test_missing_tensor(make_model_dir):
    path = make_model_dir()
    _rewrite(path, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(path)


def test_wrong_shape(make_model_dir):
    path = make_model_dir()
    _rewrite(path, lambda t: t.update({"model.layers.0.self_attn.k_proj.weight": np.zeros((64, 64), np.float32)}))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.k_proj\.weight.*\(64, 64\)"):
        load_model(path)


def test_unexpected_tensor_and_ignored_inv_freq(make_model_dir):
    path = make_model_dir()
    _rewrite(path, lambda t: t.update({"model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(8, np.float32)}))
    load_model(path)  # old checkpoints carry it; ignored
    _rewrite(path, lambda t: t.update({"model.layers.0.self_attn.q_proj.bias": np.zeros(64, np.float32)}))
    with pytest.raises(ValueError, match=r"q_proj\.bias"):
        load_model(path)


def test_missing_files(make_model_dir, tmp_path):
    with pytest.raises(FileNotFoundError):
        load_model(tmp_path / "nope")
    path = make_model_dir()
    (path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_model(path)
    sharded = make_model_dir(shards=2)
    (sharded / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002.safetensors"):
        load_model(sharded)
    no_tok = make_model_dir()
    (no_tok / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        load_model(no_tok)


def test_config_shape_mismatch_is_reported(make_model_dir, tmp_path):
    path = make_model_dir()
    other = shutil.copytree(path, tmp_path / "m")
    config = json.loads((other / "config.json").read_text())
    config["intermediate_size"] = 96
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="gate_proj.*expected"):
        load_model(other)


def test_eos_ids_are_shared(make_model_dir):
    m = load_model(make_model_dir(eos_token_ids=[0]))
    # config says <|endoftext|> (0), tokenizer_config says <|im_end|> (2): both stop generation
    assert m.config.eos_token_ids == m.tokenizer.eos_token_ids == [0, 2]


def test_save_random_model_with_real_shapes_in_small_form(tmp_path):
    config = tiny_config(num_attention_heads=8, num_key_value_heads=1, head_dim=32, tie_word_embeddings=True)
    path = save_hf_model_dir(tmp_path, config, random_weights(config, seed=1), dtype="bfloat16")
    m = load_model(path)
    assert m.weights["model.layers.0.self_attn.q_proj.weight"].shape == (256, 64)
    assert m.weights["model.layers.0.self_attn.k_proj.weight"].shape == (32, 64)


# Qwen3's ChatML in the shape of its real template: enable_thinking=False closes an empty think block.
QWEN3_STYLE_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)


@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": False}, {"enable_thinking": True}])
def test_qwen3_chat_template_renders_as_hf(tmp_path, kwargs):
    transformers = pytest.importorskip("transformers")
    config = tiny_config(architecture="Qwen3ForCausalLM")
    path = save_hf_model_dir(tmp_path / "qwen3", config, random_weights(config))
    tok_config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps(dict(tok_config, chat_template=QWEN3_STYLE_TEMPLATE)))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
    ours = load_model(path).tokenizer.apply_chat_template(messages, **kwargs)
    hf = transformers.AutoTokenizer.from_pretrained(path)
    assert ours == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
    assert ("<think>" in ours) == (kwargs.get("enable_thinking") is False)


def _bf16_packed(model):
    """What the CUDA backend uploads (backends/cuda/forward.py): every packed array, layer by layer."""
    w = model.weights
    packed = pack_weights(w, model.config, lambda name: as_bf16(w, name))
    yield from (packed.embed, packed.lm_head, packed.final_norm)
    for layer in packed.layers:
        yield from (a for a in vars(layer).values() if a is not None)


@pytest.mark.parametrize("architecture", ["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"])
def test_cuda_path_uploads_bf16_as_stored(make_model_dir, monkeypatch, architecture):
    """A sharded bf16 checkpoint goes to the device as its own bits: no tensor is ever converted to float32."""
    path = make_model_dir(dtype="bfloat16", shards=3, seed=2, architecture=architecture)
    model = load_model(path)
    expected = {name: f32_to_bf16(w) for name, w in random_weights(model.config, seed=2).items()}

    def refuse(*args):
        raise AssertionError("a bf16 tensor was converted on the cuda loading path")

    monkeypatch.setattr(loader, "bf16_to_f32", refuse)
    monkeypatch.setattr(loader, "f32_to_bf16", refuse)
    arrays = list(_bf16_packed(model))
    assert all(a.dtype == np.uint16 for a in arrays)
    assert sum(a.size for a in arrays) == sum(w.size for w in expected.values())  # the tied head counted twice
    layer0 = pack_weights(expected, model.config)  # the stored bits, fused by the same code
    np.testing.assert_array_equal(arrays[3], next(layer0.layers).input_norm)
    np.testing.assert_array_equal(arrays[0], expected["model.embed_tokens.weight"])


def test_float_checkpoints_upload_rounded_once(make_model_dir):
    for dtype in ("float32", "float16"):
        model = load_model(make_model_dir(dtype=dtype, seed=4))
        for name in ("model.layers.0.self_attn.q_proj.weight", "model.norm.weight"):
            np.testing.assert_array_equal(as_bf16(model.weights, name), f32_to_bf16(model.weights[name]))


RSS_SCRIPT = """
import sys
from tinyvllm.model.loader import load_model
from test_loader import _bf16_packed

def status_kib(key):  # VmRSS: resident now; VmHWM: its peak in this process (ru_maxrss counts the parent's too)
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":"))

model = load_model(sys.argv[1])
before = status_kib("VmRSS")
uploaded = sum(a.nbytes for a in _bf16_packed(model))  # each array dropped once counted, as once uploaded
print((status_kib("VmHWM") - before) * 1024, uploaded)
"""


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the resident set from /proc")
def test_peak_rss_of_a_sharded_load_is_bounded_by_the_largest_tensor(tmp_path):
    """Loading streams: the host's peak grows by a few of the largest tensor, not by the model."""
    config = tiny_config(vocab_size=8192, hidden_size=512, intermediate_size=2048, num_hidden_layers=16,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=64)
    path = save_hf_model_dir(tmp_path / "m", config, random_weights(config), dtype="bfloat16", shards=4)
    largest = 2 * config.vocab_size * config.hidden_size
    run = subprocess.run([sys.executable, "-c", RSS_SCRIPT, str(path)], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), *sys.path])})
    assert run.returncode == 0, run.stderr
    growth, uploaded = map(int, run.stdout.split())
    assert uploaded > 15 * largest  # the model is much larger than the bound below
    assert growth < 6 * largest, f"peak RSS grew by {growth / 2**20:.1f} MiB for {uploaded / 2**20:.1f} MiB of weights"
