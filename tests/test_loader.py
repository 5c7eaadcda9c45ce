import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import require

from tinyvllm.model.dtypes import bf16_to_f32, f32_to_bf16
from tinyvllm.model.dummy import random_weights, save_hf_model_dir, tiny_config
from tinyvllm.model import loader
from tinyvllm.model.loader import as_bf16, load_model, read_safetensors, weight_shapes, write_safetensors
from tinyvllm.model.weights import layer_parts, pack_weights


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


@pytest.mark.parametrize("chunk", [997, 1 << 30])
def test_bf16_rounding_matches_torch(monkeypatch, chunk):
    """Also in pieces that end anywhere (f32_to_bf16 converts dtypes.CHUNK values at a time), on a 2-D view that is
    not contiguous, ties (to even) and the largest finite values (rounding up to infinity) among them."""
    from tinyvllm.model import dtypes

    torch = require("torch")
    monkeypatch.setattr(dtypes, "CHUNK", chunk)
    x = np.random.default_rng(0).standard_normal((100, 300), dtype=np.float32)[:, ::3] * 100
    x[0, :4] = np.float32([1 + 2.0**-8, 1 + 3 * 2.0**-8, 3.3895e38, -3.4e38])
    got = f32_to_bf16(x)
    assert got.shape == x.shape and got.dtype == np.uint16
    theirs = torch.from_numpy(np.ascontiguousarray(x)).bfloat16().float().numpy()
    np.testing.assert_array_equal(bf16_to_f32(got), theirs)


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
    st_numpy = require("safetensors.numpy")
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
    torch = require("torch")
    st_torch = require("safetensors.torch")
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
    transformers = require("transformers")
    config = tiny_config(architecture="Qwen3ForCausalLM")
    path = save_hf_model_dir(tmp_path / "qwen3", config, random_weights(config))
    tok_config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps(dict(tok_config, chat_template=QWEN3_STYLE_TEMPLATE)))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
    ours = load_model(path).tokenizer.apply_chat_template(messages, **kwargs)
    hf = transformers.AutoTokenizer.from_pretrained(path)
    assert ours == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
    assert ("<think>" in ours) == (kwargs.get("enable_thinking") is False)


class FakeDevice:
    """Device memory as a byte array. A send is carried out only at the wait for its staging buffer (or at the end),
    as late as an asynchronous copy may run: a buffer refilled before that wait would send the wrong bytes."""

    def __init__(self, nbytes: int, buffers: list[np.ndarray]) -> None:
        self.memory = np.zeros(nbytes, np.uint8)
        self.buffers, self.pending = buffers, {}

    def send(self, i: int, nbytes: int, address: int) -> None:
        assert i not in self.pending, "a staging buffer was sent again before its wait"
        self.pending[i] = (nbytes, address)

    def wait(self, i: int) -> None:
        if i in self.pending:
            nbytes, address = self.pending.pop(i)
            self.memory[address:address + nbytes] = self.buffers[i][:nbytes]


def _streamed(model, buffer_bytes: int = 1000, num_buffers: int = 3):
    """What the CUDA backend uploads (backends/cuda/forward.py _upload_weights): each packed tensor's parts
    streamed through staging buffers to their offsets in (fake) device memory; yields every packed tensor's bytes
    as uint16, the embedding, lm_head and final norm first, then layer by layer."""
    config, shapes = model.config, weight_shapes(model.config)
    packed = [["model.embed_tokens.weight"], ["lm_head.weight"], ["model.norm.weight"]]
    packed += [names for i in range(config.num_hidden_layers) for names in layer_parts(config, i).values()]
    parts, spans, address = [], [], 0  # (address, name) of every part; (address, nbytes) of every packed tensor
    for names in packed:
        spans.append((address, sum(2 * math.prod(shapes[name]) for name in names)))
        for name in names:
            parts.append((address, name))
            address += 2 * math.prod(shapes[name])
    buffers = [np.zeros(buffer_bytes, np.uint8) for _ in range(num_buffers)]  # odd sizes: pieces cross tensors
    device = FakeDevice(address, buffers)
    loader.stream_bf16(((a, loader.Bf16Bytes(model.weights, name)) for a, name in parts), buffers, device.wait,
                       device.send)
    for i in list(device.pending):
        device.wait(i)
    for start, nbytes in spans:
        yield device.memory[start:start + nbytes].view(np.uint16)


@pytest.mark.parametrize("architecture", ["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"])
def test_cuda_path_uploads_bf16_as_stored(make_model_dir, monkeypatch, architecture):
    """A sharded bf16 checkpoint goes to the device as its own bits, streamed from the file in pieces: no tensor
    is ever converted to float32, nor read whole, at load or upload."""
    path = make_model_dir(dtype="bfloat16", shards=3, seed=2, architecture=architecture)
    expected = {name: f32_to_bf16(w) for name, w in random_weights(load_model(path).config, seed=2).items()}

    def refuse(*args):
        raise AssertionError("a bf16 tensor was converted or read whole on the cuda loading path")

    monkeypatch.setattr(loader, "bf16_to_f32", refuse)
    monkeypatch.setattr(loader, "f32_to_bf16", refuse)
    monkeypatch.setattr(loader.TensorEntry, "read", refuse)
    model = load_model(path)
    arrays = list(_streamed(model))
    packed = pack_weights(expected, model.config)  # the stored bits, fused by numpy
    want = [packed.embed, packed.lm_head, packed.final_norm]
    want += [a for layer in packed.layers for a in vars(layer).values() if a is not None]
    assert len(arrays) == len(want)
    for got, expect in zip(arrays, want):
        np.testing.assert_array_equal(got, expect.reshape(-1))


@pytest.mark.parametrize("buffer_bytes, num_buffers", [(64, 2), (4096, 3), (1 << 20, 2)])
def test_streamed_upload_of_a_float32_checkpoint_rounds_once(make_model_dir, buffer_bytes, num_buffers):
    """Tensors that are not bf16 in the file are converted once on the host, then streamed like the others."""
    model = load_model(make_model_dir(dtype="float32", seed=5, tie_word_embeddings=True))
    arrays = list(_streamed(model, buffer_bytes, num_buffers))
    packed = pack_weights(model.weights, model.config, lambda name: f32_to_bf16(model.weights[name]))
    np.testing.assert_array_equal(arrays[1], packed.embed.reshape(-1))  # the tied head: the embedding
    np.testing.assert_array_equal(arrays[5], next(packed.layers).qkv.reshape(-1))


def test_float_checkpoints_upload_rounded_once(make_model_dir):
    for dtype in ("float32", "float16"):
        model = load_model(make_model_dir(dtype=dtype, seed=4))
        for name in ("model.layers.0.self_attn.q_proj.weight", "model.norm.weight"):
            np.testing.assert_array_equal(as_bf16(model.weights, name), f32_to_bf16(model.weights[name]))


RSS_SCRIPT = """
import sys
import numpy as np
from tinyvllm.model.loader import Bf16Bytes, load_model, stream_bf16, weight_shapes

def status_kib(key):  # VmRSS: resident now; VmHWM: its peak in this process (ru_maxrss counts the parent's too)
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":"))

model = load_model(sys.argv[1])
buffers = [np.ones(1 << 20, np.uint8) for _ in range(3)]  # staging, as forward.py's pinned buffers (resident)
before = status_kib("VmRSS")
sent = []  # bytes of each send, to a device that keeps nothing
stream_bf16(((0, Bf16Bytes(model.weights, name)) for name in weight_shapes(model.config)), buffers,
            lambda i: None, lambda i, nbytes, address: sent.append(nbytes))
print((status_kib("VmHWM") - before) * 1024, sum(sent))
"""


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the resident set from /proc")
def test_peak_rss_of_a_streamed_upload_is_below_one_tensor(tmp_path):
    """The cuda path streams a bf16 checkpoint through its staging buffers: the host's peak grows by less than the
    largest tensor (no tensor is ever whole on the host), let alone by the model or a float32 copy."""
    config = tiny_config(vocab_size=8192, hidden_size=512, intermediate_size=2048, num_hidden_layers=16,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=64)
    path = save_hf_model_dir(tmp_path / "m", config, random_weights(config), dtype="bfloat16", shards=4)
    largest = 2 * config.vocab_size * config.hidden_size
    run = subprocess.run([sys.executable, "-c", RSS_SCRIPT, str(path)], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert run.returncode == 0, run.stderr
    growth, uploaded = map(int, run.stdout.split())
    assert uploaded > 15 * largest  # the model is much larger than the bound below
    assert growth < largest, f"peak RSS grew by {growth / 2**20:.1f} MiB for {uploaded / 2**20:.1f} MiB of weights"
