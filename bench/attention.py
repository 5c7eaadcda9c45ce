"""Decode attention alone, at W1's shapes: time per launch and the K/V bytes it streams per second.

    python bench/attention.py [--seqs 256,512] [--context 256,512] [--fp8] [--splits Z] [--shape H,KV,D]
                              [--compare OTHER.cu ...]

Random bf16 (or, with --fp8, e4m3) caches of Llama-3.2-1B's attention shape (32 heads, 8 KV heads, head_dim 64; --shape
4,1,256 is Gemma-3-1B's, 32,32,96 Phi-3.5-mini's),
contexts uniform in the given range, shuffled block tables of 16-token blocks; CUDA-event median of 20 launches
after a warm-up, launched by ops.Ops.attention_decode (its grid and block) with the parts the engine would cut the
contexts into at that batch (ops.decode_splits; --splits overrides). With --compare, other versions of
cuda/attention_decode.cu with the same launch geometry are timed on the same inputs (for A/B tests of a change).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from tinyvllm.backends.cuda.ops import DEFINES, HEAD_DIMS, SIGNATURES, Ops, decode_splits

BLOCK = 16


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The arguments, checked before anything needs a GPU (tests/test_bench_attention.py)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--seqs", default="256,512", help="batch sizes, comma-separated")
    parser.add_argument("--context", default="256,512", help="contexts uniform in [lo, hi]")
    parser.add_argument("--fp8", action="store_true", help="e4m3 caches (scales 1) instead of bf16")
    parser.add_argument("--splits", type=int, help="most parts of a context (default: the engine's at that batch)")
    parser.add_argument("--shape", default="32,8,64", help="heads, KV heads, head_dim (one of ops.HEAD_DIMS)")
    parser.add_argument("--compare", type=Path, nargs="*", default=[])
    args = parser.parse_args(argv)
    try:
        args.seqs = [int(n) for n in args.seqs.split(",")]
        args.context = tuple(int(n) for n in args.context.split(","))
        args.shape = tuple(int(n) for n in args.shape.split(","))
    except ValueError:
        parser.error("--seqs, --context and --shape take integers separated by commas")
    if len(args.shape) != 3 or args.shape[2] not in HEAD_DIMS or min(args.shape) < 1 or args.shape[0] % args.shape[1]:
        parser.error(f"--shape {args.shape}: give heads,kv_heads,head_dim with kv_heads dividing heads and head_dim "
                     f"one of {HEAD_DIMS}")
    if min(args.seqs) < 1:
        parser.error(f"--seqs {args.seqs}: every batch needs a sequence")
    if len(args.context) != 2 or not 1 <= args.context[0] <= args.context[1]:
        parser.error(f"--context {args.context}: give lo,hi with 1 <= lo <= hi")
    if args.splits is not None and args.splits < 1:
        parser.error(f"--splits {args.splits}: a context has at least 1 part")
    return args


def launchers(source: Path, arch: str) -> Ops:
    """Ops whose attention kernels are those of `source`, compiled for `arch`."""
    from tinyvllm.backends.cuda.kernels import compile_source

    module = compile_source(source.read_text(), DEFINES["attention_decode"], arch)
    kernels = {}
    for name, signature in SIGNATURES.items():
        if signature.file == "attention_decode":
            function = module.get_function(name)
            function.prepare(signature.arg_format)
            kernels[name] = lambda grid, block, stream, *args, f=function: f.prepared_call(grid, block, *args)
    return Ops(kernels, None)


def main() -> None:
    args = parse_args()
    import pycuda.driver as cuda  # after the arguments are checked: those need no GPU

    from tinyvllm.backends.cuda.device import Device
    from tinyvllm.backends.cuda.kernel_cache import cuda_dir

    device = Device(0)  # its context current from here on
    num_sms = device.num_sms
    lo, hi = args.context
    heads, kv_heads, d = args.shape
    versions = {"cuda/attention_decode.cu": launchers(cuda_dir() / "attention_decode.cu", device.arch)}
    for other in args.compare:
        versions[str(other)] = launchers(other, device.arch)
    rng = np.random.default_rng(0)
    for seqs in args.seqs:
        ctx = rng.integers(lo, hi + 1, seqs).astype(np.int32)
        blocks = -(-ctx // BLOCK)
        width = int(blocks.max())
        order = rng.permutation(int(blocks.sum())).astype(np.int32)
        tables = np.zeros((seqs, width), np.int32)
        offsets = np.concatenate([[0], np.cumsum(blocks)])
        for i in range(seqs):
            tables[i, : blocks[i]] = order[offsets[i]: offsets[i + 1]]
        slots = int(blocks.sum()) * BLOCK
        if args.fp8:  # finite e4m3 codes of both signs
            k, v = (cuda.to_device(rng.integers(0, 0x78, (slots, kv_heads, d), dtype=np.uint8)
                                   | (rng.integers(0, 2, (slots, kv_heads, d), dtype=np.uint8) << 7))
                    for _ in range(2))
            scales = [cuda.to_device(np.ones(kv_heads, np.float32)) for _ in range(2)]
            kv_scales = tuple(map(int, scales))
        else:
            k, v = (cuda.to_device(rng.integers(0, 1 << 16, (slots, kv_heads, d), dtype=np.uint16) & 0x3FFF)
                    for _ in range(2))  # finite bf16 bit patterns
            kv_scales = None
        width_qkv = (heads + 2 * kv_heads) * d
        q = cuda.to_device(rng.integers(0, 1 << 16, (seqs, width_qkv), dtype=np.uint16) & 0x3FFF)
        out = cuda.mem_alloc(seqs * heads * d * 2)
        splits = args.splits or decode_splits(seqs, kv_heads, heads // kv_heads, num_sms, d)
        partial_o = cuda.mem_alloc(seqs * heads * splits * d * 4)
        partial_ml = cuda.mem_alloc(seqs * heads * splits * 8)
        tables_dev, stride, ctx_dev = cuda.to_device(tables), cuda.to_device(np.array([width], np.int32)), \
            cuda.to_device(ctx)
        kv_bytes = int(ctx.sum()) * kv_heads * d * 2 * (1 if args.fp8 else 2)
        for name, ops in versions.items():
            def launch():
                ops.attention_decode(*map(int, (out, partial_o, partial_ml, q, k, v, tables_dev, stride, ctx_dev)),
                                     seqs, 0.125, heads, kv_heads, d, BLOCK, width_qkv, splits, kv_scales)
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
            print(f"{name:<36} seqs {seqs:4d}, context {lo}-{hi}, up to {splits} parts: {t * 1e6:7.1f} µs per layer, "
                  f"{kv_bytes / t / 1e12:.2f} TB/s of K/V")


if __name__ == "__main__":
    main()
