"""Write an FP8 checkpoint with 128 x 128 block scales (HF `quant_method: fp8`, `weight_block_size: [128, 128]`,
as DeepSeek-V3 and Qwen3's -FP8 releases are stored) of a preset's shapes, random values: what timing the cuda
backend's block-scaled path (cuBLASLt's block-scaled GEMM, gemv_fp8_block) needs, without a model hub.

    python bench/write_fp8_block.py DIR [PRESET]     # PRESET: tinyvllm bench --dummy-weights's, default llama-3.2-1b

Every linear layer's weight is random e4m3 codes (no NaN code) with a scale per block; embeddings, norms and the LM
head bf16. The safetensors file is written directly (its header, then each tensor's bytes), a tensor at a time.
"""

import json
import struct
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tinyvllm.model import dummy  # noqa: E402
from tinyvllm.model.dtypes import f32_to_bf16  # noqa: E402
from tinyvllm.model.loader import weight_shapes  # noqa: E402
from tinyvllm.model.layout import router_weights  # noqa: E402

BLOCK = 128
QUANTIZATION = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                "weight_block_size": [BLOCK, BLOCK]}
E4M3_NAN = (0x7F, 0xFF)


def tensors(config, rng):
    """(name, safetensors dtype, shape, a function making its bytes) of every tensor of the checkpoint."""
    routers = set(router_weights(config))
    for name, shape in weight_shapes(config).items():
        if config.tie_word_embeddings and name == "lm_head.weight":
            continue
        if len(shape) == 2 and name.startswith("model.layers.") and name not in routers:
            yield name, "F8_E4M3", shape, lambda shape=shape: codes(rng, shape)
            blocks = (-(-shape[0] // BLOCK), -(-shape[1] // BLOCK))
            yield (name.removesuffix("weight") + "weight_scale_inv", "F32", blocks,
                   lambda blocks=blocks: np.exp2(rng.uniform(-12, -10, blocks)).astype(np.float32).tobytes())
        else:
            yield name, "BF16", shape, lambda shape=shape: values(rng, shape)


def codes(rng, shape):
    out = rng.integers(0, 256, shape, dtype=np.uint8)
    out[np.isin(out, E4M3_NAN)] = 0
    return out.tobytes()


def values(rng, shape):
    x = rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02) + np.float32(len(shape) == 1)
    return f32_to_bf16(x).tobytes()


def write(directory: Path, config, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    items = list(tensors(config, rng))
    header, offset = {}, 0
    for name, dtype, shape, _ in items:
        size = int(np.prod(shape)) * {"F8_E4M3": 1, "BF16": 2, "F32": 4}[dtype]
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(encoded)) + encoded)
        for _, _, _, make in items:
            f.write(make())
    hf = config.to_hf_dict()
    (directory / "config.json").write_text(json.dumps({**hf, "quantization_config": QUANTIZATION}, indent=1))
    dummy.write_tokenizer(directory, config.vocab_size)


def main(directory: str, preset: str = "llama-3.2-1b") -> None:
    if (Path(directory) / "model.safetensors").is_file():
        return
    start = time.perf_counter()
    write(Path(directory), dummy.PRESETS[preset]())
    print(f"wrote {directory} ({preset}, FP8 128 x 128 block scales) in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main(*sys.argv[1:])
