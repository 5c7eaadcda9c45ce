"""Our GEMV kernel (cuda/gemv.cu, through Linear) against cuBLAS on a model's decode GEMMs (default Llama-3.2-1B's;
--preset names another --dummy-weights preset, a dense one), m = 1, 2, 4, 8.

    python bench/gemv.py [--runs 100] [--preset llama-3.2-1b] [--fp8 | --invariant [--chain-tile 8]]

--fp8: the FP8 GEMV (e4m3 weights with per-row scales, cuda/fp8.cu) against our bf16 GEMV on the same shapes
(the "cuBLAS" columns then hold the bf16 GEMV; bandwidth is each one's own weight bytes).
--invariant: the batch-invariant pair, gemv_chain (cuda/gemv_chain.cu, through Linear(invariant=True)) against
cuBLAS with its pinned split-free algorithm, and whether each m's rows have the same bits from both, and from cuBLAS
in a product of 256 rows that holds them; --chain-tile 8: gemv_chain in tiles of 8 weight rows (x the mma's A
operand) in place of 16.

Each time is the median over --runs single launches timed by CUDA events. Every launch is queued behind a spin
kernel, so the GPU is still busy when the host enqueues it and the host's launch latency is not timed, and the
launches rotate among enough copies of the weights (>= 256 MiB) that the weights come from HBM, not from the 50 MB
L2. Bandwidth is weight bytes / time, set against the device copy rate measured the same way (memcpy_dtod_async of
256 MiB, bytes read + written).
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable

import numpy as np
import pycuda.driver as cuda
from pycuda.compiler import SourceModule

from tinyvllm.backends.cuda.cublas import Cublas
from tinyvllm.backends.cuda.device import Device
from tinyvllm.backends.cuda.cublas import WORKSPACE_BYTES
from tinyvllm.backends.cuda.linear import Fp8Scratch, Linear
from tinyvllm.backends.cuda.tensors import BF16, E4M3, F16, F32, DeviceTensor
from tinyvllm.benchmark import decode_gemm_shapes
from tinyvllm.model.dtypes import e4m3_to_f32
from tinyvllm.model.dummy import PRESETS

WORKING_SET = 256 << 20  # weight bytes the launches of one shape rotate through: well beyond L2
SPIN_S = 100e-6  # GPU time queued before each timed launch: longer than the host takes to enqueue it
SPIN_SOURCE = """
extern "C" __global__ void spin(long long cycles) {
    const long long start = clock64();
    while (clock64() - start < cycles) {}
}
"""


class Timer:
    """Median CUDA-event time of single launches, each queued behind a spin kernel."""

    def __init__(self, stream: cuda.Stream, runs: int) -> None:
        self.stream, self.runs = stream, runs
        self.spin = SourceModule(SPIN_SOURCE, no_extern_c=True).get_function("spin")
        self.spin.prepare("q")
        clock_khz = cuda.Context.get_device().get_attribute(cuda.device_attribute.CLOCK_RATE)
        self.spin_cycles = int(SPIN_S * clock_khz * 1e3)
        self.start, self.end = cuda.Event(), cuda.Event()

    def hold(self) -> None:
        """Queue the spin kernel: the GPU stays busy while the host enqueues what follows."""
        self.spin.prepared_async_call((1,), (1, 1, 1), self.stream, self.spin_cycles)

    def median_us(self, op: Callable[[int], None]) -> float:
        """op(i) launches run i; the first few runs are warm-up."""
        for i in range(3):
            op(i)
        times = []
        for i in range(self.runs):
            self.hold()
            self.start.record(self.stream)
            op(i)
            self.end.record(self.stream)
            self.end.synchronize()
            times.append(self.start.time_till(self.end) * 1e3)
        return float(np.median(times))


class Chain8Linear(Linear):
    """Linear(invariant=True) whose gemv_chain runs in tiles of 8 weight rows (--chain-tile 8)."""

    def gemm(self, out: DeviceTensor, x: DeviceTensor, w: DeviceTensor, m: int, accumulate: bool = False) -> None:
        n, k = self._check(out, x, w, m, accumulate)
        if self.uses_chain_gemv(m, n, k):
            self.ops.gemv_chain(out.ptr, x.ptr, w.ptr, m, n, k, out.dtype == F32, accumulate, tile_rows=8)
        else:
            super().gemm(out, x, w, m, accumulate)


def copy_rate(timer: Timer) -> float:
    """Device-to-device copy rate, bytes read + written per second."""
    nbytes = 256 << 20
    src, dst = cuda.mem_alloc(nbytes), cuda.mem_alloc(nbytes)
    us = timer.median_us(lambda i: cuda.memcpy_dtod_async(dst, src, nbytes, timer.stream))
    src.free()
    dst.free()
    return 2 * nbytes / us * 1e6


def time_shape(timer: Timer, linear: Linear, blas: Cublas, n: int, k: int, out_fp32: bool, accumulate: bool,
               ms: list[int], fp8: Linear | None = None) -> dict[int, tuple[float, float]]:
    """m -> (GEMV µs, cuBLAS µs) for one weight shape; fp8: (FP8 GEMV µs through it, bf16 GEMV µs)."""
    rng = np.random.default_rng(n + k)
    bits = (rng.standard_normal((n, k), dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)
    if fp8 is not None:  # e4m3 codes but the NaNs, and a scale per row
        bits = rng.integers(0, 0x7F, (n, k), dtype=np.uint8) | (rng.integers(0, 2, (n, k), dtype=np.uint8) << 7)
        scale = cuda.to_device(np.full(n, 1e-3, np.float32))
    copies = [cuda.to_device(bits)]
    while len(copies) * bits.nbytes < WORKING_SET:
        copies.append(cuda.mem_alloc(bits.nbytes))
        cuda.memcpy_dtod(copies[-1], copies[0], bits.nbytes)
    m_max = max(ms)
    x = cuda.to_device((rng.standard_normal((m_max, k), dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16))
    out = cuda.to_device(np.zeros((m_max, n), np.float32))  # zeros: accumulating runs stay finite

    out_tensor = DeviceTensor(int(out), F32 if out_fp32 else BF16, (m_max, n))
    x_tensor = DeviceTensor(int(x), BF16, (m_max, k))
    weights = [DeviceTensor(int(copy), BF16, (n, k)) for copy in copies]
    if fp8 is not None:
        bf16_weights = [DeviceTensor(int(copy), BF16, (n, k // 2)) for copy in copies]  # half the width: as many bytes
        weights = [DeviceTensor(int(copy), E4M3, (n, k), DeviceTensor(int(scale), F32, (n,))) for copy in copies]

    def launches(gemm: Callable[..., None], m: int, ws: list[DeviceTensor]) -> Callable[[int], None]:
        return lambda i: gemm(out_tensor, x_tensor, ws[i % len(ws)], m, accumulate=accumulate)

    if fp8 is not None:
        # x quantized as rms_norm leaves it (f16 values of e4m3 codes, a scale a row), so that only the GEMV is timed
        codes = rng.integers(0, 0x7F, (m_max, k), dtype=np.uint8) | (rng.integers(0, 2, (m_max, k), np.uint8) << 7)
        values = cuda.to_device(e4m3_to_f32(codes).astype(np.float16))
        x_scale = cuda.to_device(np.full(m_max, 1e-2, np.float32))
        x_codes = DeviceTensor(int(values), F16, (m_max, k), DeviceTensor(int(x_scale), F32, (m_max,)))
        fp8_gemm = functools.partial(fp8.gemm, x_codes=x_codes)
        half = DeviceTensor(int(x), BF16, (m_max, k // 2))
        results = {m: (timer.median_us(launches(fp8_gemm, m, weights)), timer.median_us(
            lambda i, m=m: linear.gemm(out_tensor, half, bf16_weights[i % len(copies)], m, accumulate=accumulate)))
            for m in ms}
    else:
        results = {m: (timer.median_us(launches(linear.gemm, m, weights)), timer.median_us(
            launches(blas.gemm, m, weights))) for m in ms}
        if linear.invariant:
            same_bits(linear, blas, weights[0], rng, out_fp32, accumulate, ms)
    for allocation in (*copies, x, out, *([values, x_scale] if fp8 is not None else [])):
        allocation.free()
    return results


def same_bits(linear: Linear, blas: Cublas, w: DeviceTensor, rng: np.random.Generator, out_fp32: bool,
              accumulate: bool, ms: list[int]) -> None:
    """Print whether, for each m, gemv_chain's rows equal cuBLAS's at m rows and within a 256-row product."""
    n, k = w.shape
    rows = 256
    x = cuda.to_device((rng.standard_normal((rows, k), dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16))
    start = rng.standard_normal((rows, n), dtype=np.float32)
    if not out_fp32:
        start = start.view(np.uint32) >> 16
    dtype = np.float32 if out_fp32 else np.uint16
    start = start.astype(dtype)

    def run(gemm: Callable[..., None], m: int) -> np.ndarray:
        out = cuda.to_device(start)
        gemm(DeviceTensor(int(out), F32 if out_fp32 else BF16, (rows, n)), DeviceTensor(int(x), BF16, (rows, k)), w, m,
             accumulate=accumulate)
        got = cuda.from_device(out, (rows, n), dtype)
        out.free()
        return got

    whole = run(blas.gemm, rows)
    verdicts = []
    for m in ms:
        chain, cublas = run(linear.gemm, m)[:m], run(blas.gemm, m)[:m]
        verdicts.append(f"m={m}: cuBLAS at m {'same' if np.array_equal(chain, cublas) else 'DIFFERS'}, "
                        f"at {rows} {'same' if np.array_equal(chain, whole[:m]) else 'DIFFERS'}")
    x.free()
    print(f"  bits n={n} k={k}: " + "; ".join(verdicts), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--m", default="1,2,4,8")
    parser.add_argument("--preset", default="llama-3.2-1b", choices=sorted(PRESETS), help="whose decode GEMMs")
    kind = parser.add_mutually_exclusive_group()
    kind.add_argument("--fp8", action="store_true", help="the FP8 GEMV against the bf16 one on as many bytes")
    kind.add_argument("--invariant", action="store_true", help="gemv_chain against the pinned cuBLAS algorithm")
    parser.add_argument("--chain-tile", type=int, choices=(16, 8), default=16, help="--invariant: gemv_chain's rows")
    args = parser.parse_args()
    if args.chain_tile != 16 and not args.invariant:
        parser.error("--chain-tile goes with --invariant")
    ms = [int(m) for m in args.m.split(",")]
    config = PRESETS[args.preset]()
    if config.num_experts:
        parser.error(f"--preset {args.preset}: a mixture of experts (its experts run grouped, not as these GEMVs)")
    shapes, layers = decode_gemm_shapes(config), config.num_hidden_layers
    device = Device(0)
    stream = device.stream()
    blas = device.cublas(stream, device.empty("u8", (WORKSPACE_BYTES,)), invariant=args.invariant)
    linear = (Chain8Linear if args.chain_tile == 8 else Linear)(blas, device.ops(stream), invariant=args.invariant)
    fp8 = None
    if args.fp8:  # the scratch buffers are unused at m <= 8 (the GEMV quantizes x as it loads it)
        t, width = max(ms), max(k for _, k, _, _ in shapes.values())
        fp8 = Linear(blas, device.ops(stream), fp8=Fp8Scratch(device.empty(E4M3, (t, width)), device.empty(F32, (t,)),
                                                             device.empty(F32, (t, config.vocab_size))))
    timer = Timer(stream, args.runs)
    copy = copy_rate(timer)
    print(f"{cuda.Context.get_device().name()}: copy rate {copy / 1e9:.0f} GB/s (memcpy_dtod_async of 256 MiB, "
          f"bytes read + written); median of {args.runs} runs")
    print(f"{'shape':<9}{'n':>7}{'k':>6}{'m':>3}{'GEMV µs':>10}{'cuBLAS µs':>11}{'GEMV GB/s':>11}{'cuBLAS GB/s':>13}"
          f"{'GEMV/copy':>11}{'cuBLAS/copy':>13}{'speedup':>9}")
    times = {}
    for name, (n, k, out_fp32, accumulate) in shapes.items():
        times[name] = time_shape(timer, linear, blas, n, k, out_fp32, accumulate, ms, fp8)
        weight_bytes = (1 if fp8 else 2) * n * k
        for m, (ours, theirs) in times[name].items():
            ours_bw, theirs_bw = weight_bytes / ours * 1e6, weight_bytes / theirs * 1e6
            print(f"{name:<9}{n:>7}{k:>6}{m:>3}{ours:>10.1f}{theirs:>11.1f}{ours_bw / 1e9:>11.0f}"
                  f"{theirs_bw / 1e9:>13.0f}{ours_bw / copy:>11.0%}{theirs_bw / copy:>13.0%}{theirs / ours:>9.2f}")
    step_bytes = sum((1 if fp8 else 2) * n * k * (1 if name == "lm_head" else layers)
                     for name, (n, k, _, _) in shapes.items())
    print(f"\none {args.preset} decode step: {layers} layers x (qkv + o + gate_up + down) + lm_head, "
          f"{step_bytes / 1e9:.2f} GB of weights")
    print(f"{'m':>3}{'GEMV µs':>10}{'cuBLAS µs':>11}{'GEMV GB/s':>11}{'cuBLAS GB/s':>13}{'GEMV/copy':>11}"
          f"{'cuBLAS/copy':>13}{'speedup':>9}")
    for m in ms:
        ours, theirs = (sum(times[name][m][i] * (1 if name == "lm_head" else layers) for name in shapes)
                        for i in (0, 1))
        ours_bw, theirs_bw = step_bytes / ours * 1e6, step_bytes / theirs * 1e6
        print(f"{m:>3}{ours:>10.1f}{theirs:>11.1f}{ours_bw / 1e9:>11.0f}{theirs_bw / 1e9:>13.0f}"
              f"{ours_bw / copy:>11.0%}{theirs_bw / copy:>13.0%}{theirs / ours:>9.2f}")
    device.close()


if __name__ == "__main__":
    main()
