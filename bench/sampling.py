"""The sampling-side kernels alone (cuda/sampling.cu): sample and logprobs at decode shapes.

    python bench/sampling.py [--runs 30] [--rows 1,8,128,512] [--vocab 49152,128256]

For each vocabulary (SmolLM2's 49,152, Llama 3's 128,256) and row count, on float32 logits of N(0, 9), a block a
row and (up to SAMPLING_SPLIT_ROWS rows) a cluster of SAMPLING_SPLIT blocks a row ("split", as the engine runs them
unless batch_invariant): `sample`
greedy, at temperature 1 with top-p 0.9 and with top-k 50 (the radix selects), and `logprobs` with k = 0 (the
sampled token's own: two passes over the row), 2 and 20 (the radix select and the gather). Times are medians of
--runs single launches (bench/gemv.py's Timer: each behind a spin kernel, so launch latency is not timed); beside
them, one read of the rows' logits at the device copy rate. The logits stay in L2 where they fit (50 MB on an H100),
as they do after the LM head that writes them.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from tinyvllm.backends.cuda.ops import SAMPLING_SPLIT_ROWS

SAMPLE_MODES = {"greedy": (0.0, 1.0, 0), "top-p 0.9": (1.0, 0.9, 0), "top-k 50": (1.0, 1.0, 50)}
LOGPROB_KS = (0, 2, 20)


def time_vocab(ops, timer, vocab: int, row_counts: list[int], rate: float) -> None:
    import pycuda.driver as cuda

    rows = max(row_counts)
    rng = np.random.default_rng(vocab)
    logits = cuda.to_device(rng.standard_normal((rows, vocab), dtype=np.float32) * 3)
    ids = cuda.to_device(rng.integers(0, vocab, rows).astype(np.int32))
    token_lp, top_ids, top_lp, out = (cuda.mem_alloc(rows * 20 * 4) for _ in range(4))
    params = {name: [cuda.to_device(np.full(rows, v, dtype)) for v, dtype in
                     zip(mode, (np.float32, np.float32, np.int32))] for name, mode in SAMPLE_MODES.items()}
    min_p, keys = cuda.to_device(np.zeros(rows, np.float32)), cuda.to_device(np.arange(rows, dtype=np.uint32))
    print(f"vocab {vocab}")
    forms = [(n, split) for n in row_counts for split in (False, True) if not split or n <= SAMPLING_SPLIT_ROWS]
    for n, split in forms:
        cells = [f"rows {n:4d}{' split' if split else '      '}: a read {n * vocab * 4 / (rate / 2) * 1e6:7.1f} us"]
        for name, (t, p, k) in params.items():
            us = timer.median_us(lambda i: ops.sample(int(out), int(logits), n, vocab, int(t), int(p), int(k),
                                                      int(min_p), int(keys), row_split=split))
            cells.append(f"sample {name} {us:7.1f}")
        for k in LOGPROB_KS:
            us = timer.median_us(lambda i: ops.logprobs(int(token_lp), int(top_ids), int(top_lp), int(logits),
                                                        int(ids), n, vocab, k, row_split=split))
            cells.append(f"logprobs k={k} {us:7.1f}")
        print("  " + "; ".join(cells))
    for array in (logits, ids, token_lp, top_ids, top_lp, out, min_p, keys, *sum(params.values(), [])):
        array.free()


def positive_ints(text: str) -> list[int]:
    """A comma-separated list of positive integers (argparse's type: anything else is its one-line error)."""
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: positive integers, comma-separated")
    return values


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--rows", type=positive_ints, default=[1, 8, 128, 512])
    parser.add_argument("--vocab", type=positive_ints, default=[49152, 128256])
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error(f"--runs {args.runs}: at least 1")
    return args


def main() -> None:
    args = parse_args()  # before the GPU is touched: a bad value gets argparse's one line
    import pycuda.driver as cuda

    sys.path.insert(0, str(Path(__file__).parent))
    from gemv import Timer, copy_rate

    from tinyvllm.backends.cuda.device import Device

    device = Device(0)
    stream = device.stream()
    ops, timer = device.ops(stream), Timer(stream, args.runs)
    rate = copy_rate(timer)
    print(f"{cuda.Device(0).name()}: copy rate {rate / 1e9:.0f} GB/s; median of {args.runs} launches, us")
    for vocab in args.vocab:
        time_vocab(ops, timer, vocab, args.rows, rate)
    device.close()


if __name__ == "__main__":
    main()
