"""Decode attention alone, at W1's shapes: time per launch and the K/V bytes it streams per second.

    python bench/attention.py [--seqs 256,512] [--context 256,512] [--compare OTHER.cu ...]

Random bf16 caches of Llama-3.2-1B's attention shape (32 heads, 8 KV heads, head_dim 64), contexts uniform in the
given range, shuffled block tables of 16-token blocks; CUDA-event median of 20 launches after a warm-up. With
--compare, other versions of cuda/attention_decode.cu are timed on the same inputs (for A/B tests of a change).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pycuda.autoprimaryctx  # noqa: F401
import pycuda.driver as cuda

from tinyvllm.backends.cuda.kernels import CUDA_DIR, compile_source
from tinyvllm.backends.cuda.ops import DECODE_WARPS, DEFINES

HEADS, KV_HEADS, D, BLOCK = 32, 8, 64, 16


def kernel(source: Path):
    return compile_source(source.read_text(), DEFINES["attention_decode"]).get_function("attention_decode_d64_r8")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seqs", default="256,512")
    parser.add_argument("--context", default="256,512", help="contexts uniform in [lo, hi]")
    parser.add_argument("--compare", type=Path, nargs="*", default=[])
    args = parser.parse_args()
    lo, hi = map(int, args.context.split(","))
    kernels = {"cuda/attention_decode.cu": kernel(CUDA_DIR / "attention_decode.cu")}
    for other in args.compare:
        kernels[str(other)] = kernel(other)
    rng = np.random.default_rng(0)
    for seqs in map(int, args.seqs.split(",")):
        ctx = rng.integers(lo, hi + 1, seqs).astype(np.int32)
        blocks = -(-ctx // BLOCK)
        width = int(blocks.max())
        order = rng.permutation(int(blocks.sum())).astype(np.int32)
        tables = np.zeros((seqs, width), np.int32)
        offsets = np.concatenate([[0], np.cumsum(blocks)])
        for i in range(seqs):
            tables[i, : blocks[i]] = order[offsets[i]: offsets[i + 1]]
        slots = int(blocks.sum()) * BLOCK
        k, v = (cuda.to_device(rng.integers(0, 1 << 16, (slots, KV_HEADS, D), dtype=np.uint16) & 0x3FFF)
                for _ in range(2))  # finite bf16 bit patterns
        width_qkv = (HEADS + 2 * KV_HEADS) * D
        q = cuda.to_device(rng.integers(0, 1 << 16, (seqs, width_qkv), dtype=np.uint16) & 0x3FFF)
        out = cuda.mem_alloc(seqs * HEADS * D * 2)
        tables_dev, stride, ctx_dev = cuda.to_device(tables), cuda.to_device(np.array([width], np.int32)), \
            cuda.to_device(ctx)
        kv_bytes = int(ctx.sum()) * KV_HEADS * D * 2 * 2
        for name, fn in kernels.items():
            def launch():
                fn(out, out, out, q, k, v, tables_dev, stride, ctx_dev, np.float32(0.125), np.int32(HEADS),
                   np.int32(KV_HEADS), np.int32(BLOCK), np.int32(width_qkv), np.int32(1),
                   grid=(KV_HEADS, seqs, 1), block=(DECODE_WARPS * 32, 1, 1))
            launch()
            times = []
            for _ in range(20):
                a, b = cuda.Event(), cuda.Event()
                a.record()
                launch()
                b.record()
                b.synchronize()
                times.append(b.time_since(a) * 1e-3)
            t = float(np.median(times))
            print(f"{name:<36} seqs {seqs:4d}, context {lo}-{hi}: {t * 1e6:7.1f} µs per layer, "
                  f"{kv_bytes / t / 1e12:.2f} TB/s of K/V")


if __name__ == "__main__":
    main()
