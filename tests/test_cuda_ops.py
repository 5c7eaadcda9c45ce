"""The CUDA launchers (backends/cuda/ops.py) without a GPU: their argument types against the kernels' C declarations,
their geometry, and the preconditions they refuse. The kernels themselves are tested in tests/gpu."""

import ctypes
import dataclasses
import math
import re
import types
from pathlib import Path

import numpy as np
import pytest

from tinyvllm.backends.cuda import ops
from tinyvllm.backends.cuda.ops import DEFINES, SIGNATURES, Ops

CUDA_DIR = Path(__file__).resolve().parents[1] / "cuda"
KERNEL = re.compile(r'extern "C" __global__ void\s+(?:__cluster_dims__\([^)]*\)\s*)?(?:__launch_bounds__\([^)]*\)\s*)?'
                    r'([\w#]+)\s*\(([^)]*)\)')


def declared_kernels(file: str) -> dict[str, str]:
    """{kernel name pattern: normalized C parameters} of the extern "C" kernels of cuda/<file>.cu; a name made by a
    macro (attention_decode_d##D##_r##ROWS) becomes a regular expression."""
    source = (CUDA_DIR / f"{file}.cu").read_text().replace("\\\n", " ")
    kernels = {}
    for name, params in KERNEL.findall(source):
        parts = name.split("##")  # literal text and macro arguments (upper case)
        pattern = "".join(r"\w*" if re.fullmatch(r"[A-Z][A-Z0-9_]*", p) else re.escape(p) for p in parts)
        kernels[pattern] = ", ".join(" ".join(p.replace("__restrict__", "").split()) for p in params.split(","))
    return kernels


def test_each_kernel_has_a_launcher_with_its_c_parameters():
    files = sorted(p.stem for p in CUDA_DIR.glob("*.cu"))
    assert sorted({s.file for s in SIGNATURES.values()}) == files
    for file in files:
        declared = declared_kernels(file)
        names = [name for name, s in SIGNATURES.items() if s.file == file]
        for pattern in declared:  # every kernel of the file is launched
            assert any(re.fullmatch(pattern, name) for name in names), (file, pattern)
        for name in names:
            [params] = [p for pattern, p in declared.items() if re.fullmatch(pattern, name)]
            assert SIGNATURES[name].params == params, name


def test_arg_format_follows_the_c_types():
    assert SIGNATURES["rms_norm"].arg_format == "PPPPPPiff"
    assert SIGNATURES["sample"].arg_format == "PPiPPPPP"
    assert SIGNATURES["attention_decode_d128_r16"].arg_format == "PPPPPPPPPfiiiiiif"


def test_sampling_splits_a_row_over_a_cluster_only_for_small_batches_that_allow_it():
    split, most = ops.SAMPLING_SPLIT, ops.SAMPLING_SPLIT_ROWS
    for name in ("sample", "logprobs"):
        assert SIGNATURES[f"{name}_split"].params == SIGNATURES[name].params
        assert ops._sampling_grid(name, 1, True) == (f"{name}_split", (split,))
        assert ops._sampling_grid(name, most, True) == (f"{name}_split", (most * split,))
        assert ops._sampling_grid(name, most + 1, True) == (name, (most + 1,))
        assert ops._sampling_grid(name, 1, False) == (name, (1,))  # the batch-invariant mode: a block a row
    assert DEFINES["sampling"]["ROW_SPLIT"] == split


def function_bodies(source: str, head: str) -> dict[str, str]:
    """{name: body} of the functions whose declaration matches `head` (a regular expression ending at the name)."""
    bodies = {}
    for match in re.finditer(head + r"\s*\(", source):
        open_brace = source.index("{", source.index(")", match.end()))
        depth, end = 0, open_brace
        for end in range(open_brace, len(source)):
            depth += {"{": 1, "}": -1}.get(source[end], 0)
            if depth == 0:
                break
        bodies[match.group(1)] = source[open_brace + 1:end]
    return bodies


def launched_after_loop(body: str) -> bool:
    """The body's last allow_dependents_launch() comes after its first loop (and an idle warp's early return is the
    only one before it)."""
    loop, last = body.find("for ("), body.rfind("allow_dependents_launch();")
    return 0 <= loop < last and body[:loop].count("allow_dependents_launch();") <= body[:loop].count("return;")


def test_every_kernel_waits_for_the_kernel_before_it_first():
    """Kernels are launched with programmatic dependent launch (common.cuh): one that touched memory before
    waiting for the previous kernel would race with it. So each kernel, or the template function it runs, begins
    with pdl_begin(); the GEMVs alone load weights and their scales (which no kernel writes) before their wait, and
    attention_decode lets
    the next kernel launch only after its loop (common.cuh says why)."""
    headers = " ".join(p.read_text() for p in sorted(CUDA_DIR.glob("*.cuh")))
    for path in sorted(CUDA_DIR.glob("*.cu")):
        source = path.read_text().replace("\\\n", " ")
        kernels = function_bodies(source, r'extern "C" __global__ void\s+(?:__cluster_dims__\([^)]*\)\s*)?'
                                          r'(?:__launch_bounds__\([^)]*\)\s*)?([\w#]+)')
        templates = function_bodies(source + headers, r"template <[^>]*>\s*__device__ void\s+(\w+)")
        assert kernels, path
        for name, body in kernels.items():
            first = body.strip()
            forwarded = re.match(r"(\w+)\s*[<(]", first)
            if forwarded and forwarded.group(1) in templates:
                first = templates[forwarded.group(1)].strip()
            if forwarded and forwarded.group(1) in ("gemv", "gemv_chain"):  # gemv.cu's, fp8.cu's, gemv_chain.cu's
                assert "grid_dependency_wait();" in first, name
                before_wait = first.split("grid_dependency_wait();")[0]
                assert not re.search(r"__ldg\(x|x_row \+|x_row\[|quantize_x_rows\(|multiply|load_b\(", before_wait), \
                    "gemv reads x before its wait"
                assert "allow_dependents_launch();" in before_wait and not launched_after_loop(first), name
            elif forwarded and forwarded.group(1) == "attention_decode":
                assert first.startswith("grid_dependency_wait();") and launched_after_loop(first), name
            else:
                assert first.startswith("pdl_begin();"), (path.name, name, first[:80])


def with_headers(path: Path, seen: set | None = None) -> str:
    """A kernel file's source and that of every header it includes (of cuda/, recursively)."""
    seen = set() if seen is None else seen
    text = path.read_text()
    for header in re.findall(r'#include "([\w.]+)"', text):
        if header not in seen:
            seen.add(header)
            text += with_headers(CUDA_DIR / header, seen)
    return text


def test_tile_constants_come_from_python_only():
    sources = {p.stem: p.read_text() for p in CUDA_DIR.glob("*.c*")}
    for file, defines in DEFINES.items():
        for name in defines:
            assert re.search(rf"\b{name}\b", with_headers(CUDA_DIR / f"{file}.cu")), (file, name)  # it is used
            assert not any(re.search(rf"#define\s+{name}\b", s) for s in sources.values()), name  # and only -D sets it


class Recorder(dict):
    """Stands in for the compiled kernels: records each launch and its arguments, checking their count."""

    def __init__(self):
        super().__init__()
        self.launches = []
        self.args = []
        self.shared = []  # each launch's dynamic shared memory (None: its kernel's declared amount)

    def __missing__(self, name):
        def launch(grid, block, stream, *args, shared_bytes=None):
            assert len(args) == len(SIGNATURES[name].arg_format), name
            assert shared_bytes is None or 0 <= shared_bytes <= SIGNATURES[name].shared_bytes, (name, shared_bytes)
            self.launches.append((name, grid, block))
            self.args.append(args)
            self.shared.append(shared_bytes)
        return launch


@pytest.fixture
def recorder():
    return Recorder()


def test_elementwise_geometry(recorder):
    launcher = Ops(recorder, None)
    launcher.silu_and_mul(1, 2, 7, 8192)
    launcher.resolve_tokens(1, 2, 3, 257)
    launcher.rms_norm(1, 2, 3, 0, 5, 2048, 1e-5)
    launcher.logprobs(1, 2, 3, 4, 5, 9, 128256, ops.MAX_TOP_LOGPROBS)
    assert recorder.launches == [("silu_and_mul", (7, 4), (256, 1, 1)), ("resolve_tokens", (2,), (256, 1, 1)),
                                 ("rms_norm", (5,), (256, 1, 1)), ("logprobs", (9,), (1024, 1, 1))]


@pytest.mark.parametrize("hidden,threads", [(576, 96), (2048, 256), (8192, 1024), (12296, 1024), (16384, 1024)])
def test_rms_norm_geometry(recorder, hidden, threads):
    """A chunk of 8 entries per thread, in whole warps, up to 1024 threads; past that two chunks a thread."""
    Ops(recorder, None).rms_norm(1, 2, 3, 0, 7, hidden, 1e-5)
    assert recorder.launches == [("rms_norm", (7,), (threads, 1, 1))]


@pytest.mark.parametrize("heads,kv_heads,d,splits,kernel,grid", [
    (32, 8, 64, 1, "attention_decode_d64_r8", (4, 5, 1)),  # group 4: rows 4-15 of the tile empty; 2 warps a block
    (32, 2, 128, 3, "attention_decode_d128_r16", (1, 5, 3)),  # group 16
    (32, 1, 64, 2, "attention_decode_d64_r16", (1, 5, 2)),  # group 32: two warps per KV head
    (27, 9, 64, 1, "attention_decode_d64_r8", (5, 5, 1)),  # 9 KV heads: the last block's second warp idle
    (32, 32, 96, 1, "attention_decode_d96_r8", (16, 5, 1)),  # Phi-3.5-mini: group 1
    (4, 1, 256, 2, "attention_decode_d256_r8", (1, 5, 2)),  # Gemma-3-1B: one warp a block at head_dim 256
    (8, 4, 256, 1, "attention_decode_d256_r8", (4, 5, 1)),  # Gemma-2-2B
])
def test_attention_decode_geometry(recorder, heads, kv_heads, d, splits, kernel, grid):
    context_lens = 9
    Ops(recorder, None).attention_decode(*range(1, context_lens + 1), 5, 0.125, heads, kv_heads, d, 16, 4096, splits)
    combine = [("attention_combine", (heads, 5), (d, 1, 1))] if splits > 1 else []
    warps = ops.DECODE_WIDE_WARPS if d > 128 else ops.DECODE_WARPS
    assert recorder.launches == [(kernel, grid, (warps * 32, 1, 1)), *combine]
    if combine:  # the combine reads the contexts, to know how many parts each has
        assert recorder.args[-1] == (1, 2, 3, context_lens, splits, 0)


@pytest.mark.parametrize("values", [True, False])
def test_attention_decode_merge_quantizes_only_where_it_merges(recorder, values):
    """With a QuantizedOutput the merge of the parts writes the rows' codes and scales (a block a sequence) and
    attention_decode says so; in one part, or with rows wider than the merge's registers hold, it quantizes nothing
    (the product's own quantize pass runs)."""
    target = ops.QuantizedOutput(100, 200, values)
    kernel = "attention_combine_quantize" + "_values" * values

    def decode(heads, d, splits):
        recorder.launches.clear()
        recorder.args.clear()
        return Ops(recorder, None).attention_decode(*range(1, 10), 5, 0.125, heads, 8, d, 16, 4096, splits,
                                                    quantized=target)

    assert decode(32, 64, 3)
    assert recorder.launches[-1] == (kernel, (5,), (ops.COMBINE_ROW_THREADS, 1, 1))
    assert recorder.args[-1] == (100, 200, 1, 2, 3, 9, 32, 64, 3, 0)  # codes, scales, out, parts, contexts, ...
    assert not decode(32, 64, 1) and [name for name, _, _ in recorder.launches] == ["attention_decode_d64_r8"]
    widest = ops.COMBINE_ROW_THREADS * ops.VECTOR * ops.COMBINE_ROW_GROUPS
    assert ops.combine_quantizes(widest) and not ops.combine_quantizes(widest + ops.VECTOR)
    assert not decode(widest // 128 + 8, 128, 3) and recorder.launches[-1][0] == "attention_combine"
    with pytest.raises(ValueError, match="exceed"):
        Ops(recorder, None).attention_combine_quantize(target, 1, 2, 3, 4, 5, widest // 128 + 8, 128, 3)


def test_decode_splits():
    # 4 blocks (of 2 warps) per sequence here: small batches cut as far as ~2 blocks per SM need, at least 8 parts
    assert ops.decode_splits(1, 8, 4, num_sms=132) == ops.MAX_SPLITS
    assert ops.decode_splits(4, 8, 4, num_sms=132) == 17  # 16 blocks x 17 >= 264
    assert ops.decode_splits(40, 8, 4, num_sms=132) == ops.SMALL_BATCH_SPLITS  # 160 blocks: x2 would do
    assert ops.decode_splits(66, 8, 4, num_sms=132) == 1  # 264 blocks
    # head_dim 256: blocks of one warp, ~4 per SM (as many warps): Gemma-2-2B's 4 blocks per sequence
    assert ops.decode_splits(4, 4, 2, num_sms=132, head_dim=256) == ops.MAX_SPLITS  # 16 blocks x 33 >= 528
    assert ops.decode_splits(66, 4, 2, num_sms=132, head_dim=256) == ops.SMALL_BATCH_SPLITS  # 264 blocks: x2
    assert ops.decode_splits(132, 4, 2, num_sms=132, head_dim=256) == 1  # 528 blocks


def test_prefill_tiles(recorder):
    tile_seq, tile_row0 = ops.prefill_tiles(np.array([1, 64, 65, 130]))
    assert tile_seq.tolist() == [0, 1, 2, 2, 3, 3, 3]
    assert tile_row0.tolist() == [0, 0, 0, 64, 0, 64, 128]
    rng = np.random.default_rng(0)
    for _ in range(100):  # the staging buffer's bound holds for any chunk
        group, lens = int(rng.integers(1, 17)), rng.integers(1, 300, int(rng.integers(1, 20)))
        assert len(ops.prefill_tiles(lens * group)[0]) <= ops.max_prefill_tiles(int(lens.sum()), len(lens), group)
    Ops(recorder, None).attention_prefill(*range(1, 11), 7, 0.125, 32, 8, 128, 16, 6144)
    assert recorder.launches == [("attention_prefill_d128", (7, 8), (128, 1, 1))]


# 300 rows: 19 tiles of 16 rows; a block of 8 warps holds 8 / split tiles, split = the warps one tile's k keeps busy;
# past one iteration of 256 k per warp, the pipelined form
@pytest.mark.parametrize("k,blocks,kernel", [(64, 3, "gemv_f32"), (512, 5, "gemv_f32"), (1024, 10, "gemv_f32"),
                                             (2048, 19, "gemv_f32"), (2056, 19, "gemv_f32_pipelined"),
                                             (8192, 19, "gemv_f32_pipelined")])
def test_gemv_splits_k_across_warps(recorder, k, blocks, kernel):
    Ops(recorder, None, num_sms=132).gemv(1, 2, 3, 8, 300, k, True, False)
    assert recorder.launches == [(kernel, (blocks,), (256, 1, 1))]


def test_gemv_pipelined_only_in_one_wave_at_one_block_per_sm(recorder):
    Ops(recorder, None, num_sms=132).gemv(1, 2, 3, 1, 2048, 8192, True, True)  # Llama-3.2-1B's down: 128 blocks
    Ops(recorder, None, num_sms=100).gemv(1, 2, 3, 1, 2048, 8192, True, True)
    Ops(recorder, None).gemv(1, 2, 3, 1, 2048, 8192, True, True)  # SM count unknown
    Ops(recorder, None, num_sms=132).gemv(1, 2, 3, 1, 4096, 4096, False, False)  # 8B's O: 256 blocks
    assert [name for name, _, _ in recorder.launches] == ["gemv_f32_pipelined", "gemv_f32", "gemv_f32", "gemv_bf16"]


def test_gemv_swiglu_shares_the_gemv_geometry(recorder):
    Ops(recorder, None, num_sms=132).gemv_swiglu(1, 2, 3, 1, 16384, 2048)  # Llama-3.2-1B's gate/up at batch 1
    Ops(recorder, None, num_sms=132).gemv_swiglu(1, 2, 3, 8, 1040, 4104)  # 3 iterations, 65 blocks
    assert recorder.launches == [("gemv_swiglu_bf16", (1024,), (256, 1, 1)),
                                 ("gemv_swiglu_bf16_pipelined", (65,), (256, 1, 1))]


def test_rope_and_cache_geometry(recorder):
    launcher = Ops(recorder, None)
    launcher.rope_and_cache(*range(1, 7), 300, 32, 8, 64, 3072)
    launcher.rope_and_cache(*range(1, 7), 1, 32, 8, 64, 3072, (7, 8))
    # (32 + 8) heads x 8 rotations of 4 pairs + 8 x 8 copies of 8 V entries = 384 threads
    assert recorder.launches == [("rope_and_cache_bf16", (300, 3), (128, 1, 1)),
                                 ("rope_and_cache_fp8", (1, 3), (128, 1, 1))]


def test_rope_fuses_qk_norm_only_where_a_head_is_a_lane_group():
    """A fused q/k norm needs the whole head rotated and head_dim / 8 lanes a power of two up to a warp."""
    from tinyvllm.backends.cuda.ops import QkNorm, rope_fuses_qk_norm

    assert [rope_fuses_qk_norm(d, d) for d in (64, 96, 128, 256, 512)] == [True, False, True, True, False]
    assert not rope_fuses_qk_norm(128, 96)
    with pytest.raises(ValueError, match="cannot fuse the q/k norms of heads of 96"):
        Ops(Recorder(), None).rope_and_cache(*range(1, 7), 2, 32, 32, 96, 9216, qk_norm=QkNorm(7, 8, 1e-6))


def test_rope_and_cache_partial_rotary_geometry(recorder):
    # Phi-4-mini's heads: 96 of 128 dims rotated; (24 + 8) heads x 12 rotations + 8 x 4 copies of 8 unrotated K
    # entries + 8 x 16 copies of 8 V entries = 544 threads
    Ops(recorder, None).rope_and_cache(*range(1, 7), 2, 24, 8, 128, 5120, rotary_dim=96)
    assert recorder.launches == [("rope_and_cache_bf16", (2, 5), (128, 1, 1))]
    assert recorder.args[-1][6:11] == (24, 8, 128, 96, 5120)


def test_window_and_softcap_reach_the_attention_kernels(recorder):
    launcher = Ops(recorder, None)
    launcher.attention_decode(*range(1, 10), 5, 0.125, 32, 8, 64, 16, 4096, 3, window=512, softcap=50.0)
    launcher.attention_prefill(*range(1, 11), 7, 0.125, 32, 8, 128, 16, 6144, window=4096, softcap=50)
    decode, combine, prefill = recorder.args
    assert decode[-2:] == (512, 50.0) and combine[-1] == 512  # the combine cuts the parts as the kernel did
    assert prefill[-2:] == (4096, 50.0) and isinstance(prefill[-1], float)


@pytest.mark.parametrize("launch,message", [
    (lambda o: o.rms_norm(1, 2, 3, 0, 4, 1001, 1e-5), "hidden 1001 is not a multiple of 8"),
    (lambda o: o.rms_norm(1, 2, 3, 0, 4, 16392, 1e-5), "hidden 16392 is over the 16384 one block holds"),
    (lambda o: o.embedding(1, 2, 3, 4, 12), "hidden 12 is not a multiple of 8"),
    (lambda o: o.silu_and_mul(1, 2, 3, 100), "intermediate_size 100"),
    (lambda o: o.rope_and_cache(*range(1, 7), 5, 32, 8, 60, 2880), "head_dim 60 is not a multiple of 8"),
    (lambda o: o.rope_and_cache(*range(1, 7), 5, 32, 8, 64, 2560), "32 \\+ 2 \\* 8 heads of 64 do not fit"),
    (lambda o: o.logprobs(1, 2, 3, 4, 5, 6, 100, ops.MAX_TOP_LOGPROBS + 1), "k = 65 not in 0..64"),
    (lambda o: o.gemv(1, 2, 3, 9, 64, 64, False, False), "m = 9 rows"),
    (lambda o: o.gemv(1, 2, 3, 1, 64, 1001, False, False), "k 1001"),
    (lambda o: o.gemv_swiglu(1, 2, 3, 9, 64, 64), "gemv_swiglu_bf16: m = 9 rows"),
    (lambda o: o.gemv_swiglu(1, 2, 3, 1, 1000, 64), "n = 1000 rows are not whole groups"),
    (lambda o: o.attention_decode(*range(1, 10), 5, 0.1, 32, 8, 80, 16, 4096, 1), "head_dim 80"),
    (lambda o: o.attention_prefill(*range(1, 11), 7, 0.1, 32, 8, 80, 16, 4096), "head_dim 80"),
    (lambda o: o.attention_decode(*range(1, 10), 5, 0.1, 32, 8, 64, 16, 4096, 0), "num_splits 0 < 1"),
    (lambda o: o.attention_prefill(*range(1, 11), 7, 0.1, 30, 8, 64, 16, 4096), "30 query heads"),
    (lambda o: o.attention_decode(*range(1, 10), 5, 0.1, 32, 8, 64, 16, 4096, 1, window=-1), "window -1"),
    (lambda o: o.attention_prefill(*range(1, 11), 7, 0.1, 32, 8, 64, 16, 4096, softcap=-1.0), "softcap -1.0 < 0"),
    (lambda o: o.rope_and_cache(*range(1, 7), 5, 32, 8, 64, 3072, rotary_dim=36), "rotary_dim 36 is not a multiple"),
    (lambda o: o.rope_and_cache(*range(1, 7), 5, 32, 8, 64, 3072, rotary_dim=72), "rotary_dim 72 not in 1..64"),
])
def test_launchers_refuse_shapes_their_kernels_cannot_run(recorder, launch, message):
    with pytest.raises(ValueError, match=message):
        launch(Ops(recorder, None))
    assert recorder.launches == []


# ---- device tensors, Linear's dispatch, and the whole forward's launches on a stand-in device ---------------------

from dataclasses import fields  # noqa: E402

from tinyvllm.backends.cuda import cublas  # noqa: E402  (no CUDA needed to import it)
from tinyvllm.backends.cuda.linear import Fp8Scratch, Linear  # noqa: E402
from tinyvllm.backends.cuda.tensors import BF16, E4M3, F16, F32, DeviceLayer, DeviceTensor  # noqa: E402
from tinyvllm.model.weights import LayerWeights  # noqa: E402


def test_device_tensor_sizes_come_from_the_dtype():
    t = DeviceTensor(1000, BF16, (3, 8))
    assert (t.nbytes, t.rows, t.row_bytes, t.row(2), t.element(5)) == (48, 3, 16, 1032, 1010)
    assert DeviceTensor(0, E4M3, (4, 4)).nbytes == 16 and DeviceTensor(0, F32, (2, 3, 4)).rows == 6
    with pytest.raises(ValueError, match="unknown device dtype 'fp4'"):
        DeviceTensor(0, "fp4", (1,))


def test_device_layer_has_the_host_layers_fields():
    assert [f.name for f in fields(DeviceLayer)] == [f.name for f in fields(LayerWeights)]
    assert [f.name for f in fields(DeviceLayer) if f.default is None] == ["gate_up", "down", "qkv_bias", "q_norm",
                                                                           "k_norm",
                                                                           "attn_out_norm", "mlp_out_norm", "router",
                                                                           "experts_gate_up", "experts_down"]


class RecordingBlas:
    """Stands in for Cublas: records each GEMM's (out, x, w, m, accumulate) and checks its types."""

    blocks = True  # whether cuBLASLt has block-scaled FP8 algorithms (scales_blocks)

    def __init__(self, invariant=False, scaled=False):
        self.calls = []
        self.exact_rows, self.algos, self.invariant = frozenset(), {}, invariant
        self.scaled = scaled  # whether gemm_scaled has an algorithm (cuBLASLt's outer-vector FP8 scales)

    def gemm(self, out, x, w, m, accumulate=False):
        cublas.gemm_types(out, x, w)
        self.calls.append((out, x, w, m, accumulate))

    def scales_blocks(self, n, k):
        return self.blocks and not self.invariant

    def gemm_scaled(self, out, x, w, m, accumulate=False):
        assert x.dtype == w.dtype == E4M3
        if cublas.scale_kind(w) == "block":
            assert x.scale.shape == (-(-w.shape[1] // 128) * m,) and m % 4 == 0
            self.calls.append(("block", out, x, w, m, accumulate))
            return self.blocks
        assert x.scale.shape == (m,) and w.scale.shape == w.shape[:1]
        if self.scaled:
            self.calls.append(("scaled", out, x, w, m, accumulate))
        return self.scaled

    def tune(self, out, x, w, m, elapsed):
        cublas.gemm_types(out, x, w)
        return 0

    def close(self):
        pass


def linear_layer(recorder):
    return Linear(RecordingBlas(), Ops(recorder, None, num_sms=132))


def test_linear_picks_its_kernel_by_the_weights_dtype_and_rows(recorder):
    linear = linear_layer(recorder)
    x, w = DeviceTensor(10, BF16, (16, 2048)), DeviceTensor(20, BF16, (3072, 2048))
    out, residual = DeviceTensor(30, BF16, (16, 3072)), DeviceTensor(40, F32, (16, 3072))
    linear.gemm(out, x, w, 8)
    linear.gemm(residual, x, w, 1, accumulate=True)
    linear.gemm(out, x, w, 9)  # past the GEMV's rows: cuBLAS
    assert [name for name, _, _ in recorder.launches] == ["gemv_bf16", "gemv_f32"]
    assert recorder.args == [(30, 10, 20, 8, 3072, 2048, 8, 0), (40, 10, 20, 1, 3072, 2048, 8, 1)]
    assert linear.blas.calls == [(out, x, w, 9, False)]


def test_linear_refuses_what_it_cannot_run(recorder):
    linear = linear_layer(recorder)
    x, out = DeviceTensor(10, BF16, (4, 64)), DeviceTensor(30, F32, (4, 32))
    with pytest.raises(ValueError, match="needs a scale per row or per 128 x 128 block"):
        linear.gemm(out, x, DeviceTensor(20, E4M3, (32, 64)), 1)  # no scales, no fp8 scratch
    with pytest.raises(ValueError, match="do not fit"):
        linear.gemm(out, x, DeviceTensor(20, BF16, (32, 48)), 1)  # k 48 against x's 64
    with pytest.raises(ValueError, match="do not fit"):
        linear.gemm(out, x, DeviceTensor(20, BF16, (32, 64)), 5)  # 5 rows in buffers of 4
    with pytest.raises(ValueError, match="bf16 inputs into bf16 or f32 outputs, not f32 into f32"):
        linear.gemm(out, DeviceTensor(10, F32, (4, 64)), DeviceTensor(20, BF16, (32, 64)), 1)
    assert recorder.launches == [] and linear.blas.calls == []


def test_gate_up_swiglu_dispatch(recorder):
    linear = linear_layer(recorder)
    x, w = DeviceTensor(10, BF16, (16, 2048)), DeviceTensor(20, BF16, (16384, 2048))
    act, gate_up = DeviceTensor(30, BF16, (16, 8192)), DeviceTensor(40, BF16, (16, 16384))
    linear.gate_up_swiglu(act, x, w, 1, gate_up)
    linear.gate_up_swiglu(act, x, w, 16, gate_up)
    assert [name for name, _, _ in recorder.launches] == ["gemv_swiglu_bf16", "silu_and_mul"]
    assert recorder.args[1] == (30, 40, 8192, 8) and linear.blas.calls == [(gate_up, x, w, 16, False)]


def test_cublas_types_come_from_the_tensors():
    x, w = DeviceTensor(1, BF16, (4, 64)), DeviceTensor(2, BF16, (32, 64))
    assert cublas.gemm_types(DeviceTensor(3, F32, (4, 32)), x, w) == cublas.BF16_GEMM_F32_OUT
    assert cublas.gemm_types(DeviceTensor(3, BF16, (4, 32)), x, w) == cublas.BF16_GEMM
    with pytest.raises(ValueError, match="e4m3 weights and bf16 inputs"):
        cublas.gemm_types(DeviceTensor(3, F32, (4, 32)), x, DeviceTensor(2, E4M3, (32, 64)))
    codes, w8 = DeviceTensor(1, E4M3, (4, 64)), DeviceTensor(2, E4M3, (32, 64))
    assert cublas.gemm_types(DeviceTensor(3, F32, (4, 32)), codes, w8) == cublas.FP8_GEMM
    with pytest.raises(ValueError, match="e4m3 weights into a bf16 output is not supported \\(f32\\)"):
        cublas.gemm_types(DeviceTensor(3, BF16, (4, 32)), codes, w8)


def fp8_linear(recorder, t=16, k=2048, n=16384):
    scratch = Fp8Scratch(DeviceTensor(100, E4M3, (t, k)), DeviceTensor(200, F32, (t,)), DeviceTensor(300, F32, (t, n)),
                         DeviceTensor(400, F16, (8, k)))
    return Linear(RecordingBlas(), Ops(recorder, None, num_sms=132), fp8=scratch)


def test_linear_runs_block_scaled_e4m3_weights_with_their_block_scales(recorder):
    """A weight with 128 x 128 block scales (an FP8 checkpoint's, as stored): its input quantized per row and 128
    columns, then up to 8 rows through gemv_fp8_block on the f16 code values; more through cuBLASLt's block-scaled
    GEMM on the rows in whole fours, the rest (1-3 rows) through the GEMV; a gate/up projection's product then
    its activation on gate rows before up rows (group = the units), not the interleaved GEMV epilogue."""
    linear = fp8_linear(recorder)
    linear.fp8 = dataclasses.replace(linear.fp8, group_scales=DeviceTensor(500, F32, (16 * 16,)))
    n, k = 3072, 2048
    w = DeviceTensor(20, E4M3, (n, k), DeviceTensor(50, F32, (n // 128, cublas.block_scale_stride(k))))
    x, out = DeviceTensor(10, BF16, (16, k)), DeviceTensor(30, F32, (16, n))
    for m in (1, 12, 11):
        linear.gemm(out, x, w, m, accumulate=True)
    assert [name for name, _, _ in recorder.launches] == [
        "quantize_fp8_groups_values", "gemv_fp8_block_f32", "quantize_fp8_groups", "quantize_fp8_groups",
        "quantize_fp8_groups_values", "gemv_fp8_block_f32"]
    quantized = [(a[0], a[1], a[2], a[3], grid) for a, (_, grid, _) in zip(recorder.args, recorder.launches)
                 if len(a) == 5]
    assert quantized == [(400, 500, 10, 1, (1, 2)), (100, 500, 10, 12, (12, 2)), (100, 500, 10, 8, (8, 2)),
                         (400, 500, 10 + 8 * 2 * k, 3, (3, 2))]
    gemvs = [a for name, a in zip([n for n, _, _ in recorder.launches], recorder.args) if name.startswith("gemv")]
    assert gemvs == [(30, 400, 20, 50, 500, 1, n, k, 4, 1), (30 + 8 * 4 * n, 400, 20, 50, 500, 3, n, k, 4, 1)]
    assert [(c[0], c[1], c[2].ptr, c[2].scale.shape, c[3].scale, c[4], c[5]) for c in linear.blas.calls] == [
        ("block", out, 100, (12 * 16,), w.scale, 12, True), ("block", out, 100, (8 * 16,), w.scale, 8, True)]
    recorder.launches.clear()
    act, gate_up = DeviceTensor(60, BF16, (16, n // 2)), DeviceTensor(70, BF16, (16, n))
    assert linear.gate_up_swiglu(act, x, w, 1, gate_up, down_e4m3=True) is None
    assert [name for name, _, _ in recorder.launches] == ["quantize_fp8_groups_values", "gemv_fp8_block_bf16",
                                                          "silu_and_mul"]
    assert recorder.args[-1] == (60, 70, n // 2, n // 2)


def test_linear_runs_e4m3_weights_through_fp8(recorder):
    """An e4m3 weight: gemv_fp8 for up to 8 rows (any weight size) on the input quantized by the kernel that wrote
    it (x_codes: f16 values of e4m3 codes with their scales), else by quantize_fp8_values into the scratch values;
    beyond 8 rows the producer's e4m3 codes (x_codes), else the input quantized per token into the scratch codes,
    cuBLASLt's FP8 GEMM into the float32 scratch and scale_rows_cols; the gate/up GEMV ends in SwiGLU, the gate/up
    GEMM in the activation quantized for the down GEMM."""
    linear = fp8_linear(recorder)
    x, w = DeviceTensor(10, BF16, (16, 2048)), DeviceTensor(20, E4M3, (3072, 2048), DeviceTensor(21, F32, (3072,)))
    out, residual = DeviceTensor(30, BF16, (16, 3072)), DeviceTensor(40, F32, (16, 3072))
    codes = DeviceTensor(90, F16, (8, 2048), DeviceTensor(91, F32, (8,)))
    linear.gemm(residual, x, w, 8, accumulate=True)
    linear.gemm(residual, x, w, 8, x_codes=codes)
    linear.gemm(out, x, w, 9)  # beyond 8 rows without x_codes quantize_fp8 quantizes x itself
    assert [name for name, _, _ in recorder.launches] == ["quantize_fp8_values", "gemv_fp8_f32", "gemv_fp8_f32",
                                                          "quantize_fp8", "scale_rows_cols_bf16"]
    # split 4: each warp one full iteration of 512 codes; 192 tiles of 16 rows, 2 a block
    assert recorder.args == [(400, 200, 10, 2048), (40, 400, 20, 21, 200, 8, 3072, 2048, 4, 1),
                             (40, 90, 20, 21, 91, 8, 3072, 2048, 4, 0), (100, 200, 10, 2048),
                             (30, 300, 200, 21, 3072, 0)]
    assert [grid for _, grid, _ in recorder.launches][1:3] == [(96,), (96,)]
    with pytest.raises(ValueError, match="x_codes of an FP8 GEMV of 8 rows of 2048"):
        linear.gemm(residual, x, w, 8, x_codes=DeviceTensor(90, F16, (4, 2048), DeviceTensor(91, F32, (4,))))
    with pytest.raises(ValueError, match="x_codes of an FP8 GEMV"):
        linear.gemm(residual, x, w, 8, x_codes=DeviceTensor(90, BF16, (8, 2048), DeviceTensor(91, F32, (8,))))
    with pytest.raises(ValueError, match="x_codes of an FP8 GEMM of 9 rows of 2048: f16"):
        linear.gemm(out, x, w, 9, x_codes=codes)  # the GEMV's f16 values are not the GEMM's e4m3 codes
    [(acc, codes, weight, m, accumulate)] = linear.blas.calls
    assert (acc.ptr, acc.dtype, acc.shape, codes.ptr, codes.dtype, codes.shape, weight, m, accumulate) == \
        (300, F32, (9, 3072), 100, E4M3, (9, 2048), w, 9, False)
    act, gate_up = DeviceTensor(50, BF16, (16, 8192)), DeviceTensor(60, BF16, (16, 16384))
    wg = DeviceTensor(70, E4M3, (16384, 2048), DeviceTensor(71, F32, (16384,)))
    recorder.launches.clear()
    linear.gate_up_swiglu(act, x, wg, 1, gate_up, x_codes=DeviceTensor(90, F16, (8, 2048), DeviceTensor(91, F32, (8,))))
    # scratch codes of 16 x 2048 cannot hold 9 rows of 8192 units: the activation in bf16, quantized by the down GEMM
    assert linear.gate_up_swiglu(act, x, wg, 9, gate_up, down_e4m3=True) is None
    wide_scratch = fp8_linear(recorder, k=8192)
    assert wide_scratch.gate_up_swiglu(act, x, wg, 9, gate_up, down_e4m3=True) == wide_scratch.input_codes(
        9, 8192) == DeviceTensor(100, E4M3, (9, 8192), DeviceTensor(200, F32, (9,)))  # into the scratch codes
    assert [name for name, _, _ in recorder.launches] == ["gemv_swiglu_fp8", "quantize_fp8", "scale_rows_cols_bf16",
                                                          "silu_and_mul", "quantize_fp8", "scale_rows_cols_bf16",
                                                          "silu_and_mul_e4m3"]
    assert recorder.launches[-1][1:] == ((9,), (256, 1, 1)) and recorder.args[-1] == (100, 200, 60, 8192)
    recorder.launches.clear()  # a bf16 down projection (a checkpoint's unquantized layer): the activation in bf16
    assert wide_scratch.gate_up_swiglu(act, x, wg, 9, gate_up) is None
    assert [name for name, _, _ in recorder.launches] == ["quantize_fp8", "scale_rows_cols_bf16", "silu_and_mul"]
    assert recorder.args[-1][0] == 50  # out
    # the producer's e4m3 codes: no quantize_fp8 before the GEMM, the scales theirs
    recorder.launches.clear()
    given = DeviceTensor(110, E4M3, (9, 2048), DeviceTensor(120, F32, (9,)))
    linear.gemm(out, x, w, 9, x_codes=given)
    assert [name for name, _, _ in recorder.launches] == ["scale_rows_cols_bf16"] and recorder.args[-1][2] == 120
    assert linear.blas.calls[-1][1].ptr == 110 and linear.input_codes(8, 2048) is None  # 8 rows: the GEMV's
    recorder.launches.clear()
    wide = DeviceTensor(80, E4M3, (64, 16400), DeviceTensor(81, F32, (64,)))
    fp8_linear(recorder, k=16400).gemm(DeviceTensor(30, BF16, (16, 64)), DeviceTensor(10, BF16, (16, 16400)), wide, 8)
    assert [name for name, _, _ in recorder.launches] == ["quantize_fp8_values", "gemv_fp8_bf16_pipelined"]  # any k
    with pytest.raises(ValueError, match="fp8 scratch buffers hold it"):
        fp8_linear(recorder, k=1024).gemm(out, x, w, 9)  # 9 rows of 2048 codes: over the 16 x 1024 scratch
    small = Linear(RecordingBlas(), Ops(recorder, None, num_sms=132), fp8=Fp8Scratch(
        DeviceTensor(100, E4M3, (16, 2048)), DeviceTensor(200, F32, (16,)), DeviceTensor(300, F32, (4, 3072))))
    recorder.launches.clear()
    recorder.args.clear()
    small.gemm(out, x, w, 9)  # an accumulator of 4 rows: the product in pieces of 4, 4 and 1 rows
    assert [name for name, _, _ in recorder.launches] == ["quantize_fp8"] + ["scale_rows_cols_bf16"] * 3
    assert [(a[0], a[2], grid[0]) for a, (_, grid, _) in zip(recorder.args[1:], recorder.launches[1:])] == [
        (30 + r0 * 2 * 3072, 200 + 4 * r0, rows) for r0, rows in ((0, 4), (4, 4), (8, 1))]
    assert [(c[1].ptr, c[1].shape, c[3]) for c in small.blas.calls] == [(100 + r0 * 2048, (rows, 2048), rows)
                                                                        for r0, rows in ((0, 4), (4, 4), (8, 1))]
    scaled = fp8_linear(recorder)  # cuBLASLt with outer-vector scales: it scales and adds itself
    scaled.blas.scaled = True
    recorder.launches.clear()
    scaled.gemm(residual, x, w, 9, accumulate=True)
    assert [name for name, _, _ in recorder.launches] == ["quantize_fp8"]
    [(tag, into, codes, weight, m, accumulate)] = scaled.blas.calls
    assert (into, codes.ptr, codes.shape, codes.scale.ptr, weight, m, accumulate) == (residual, 100, (9, 2048), 200, w,
                                                                                     9, True)


def test_nothing_touches_a_gpu_at_import():
    """No device is chosen, and no CUDA library is loaded, when the backend's modules are imported."""
    package = Path(__file__).resolve().parents[1] / "tinyvllm"
    for path in package.rglob("*.py"):
        assert "autoprimaryctx" not in path.read_text(), path
    for name in ("driver", "cublas"):
        source = (package / "backends" / "cuda" / f"{name}.py").read_text()
        assert not re.search(r"^\w+ = .*ctypes\.CDLL|^_lib = ", source, re.M), name


class FakeDriver:
    """Stands in for pycuda.driver: the copies, memsets and events forward.py calls, doing nothing."""

    class Event:
        def record(self, stream=None):
            pass

        def synchronize(self):
            pass

        def query(self):
            return True

    class Memcpy2D:
        def set_src_device(self, address):
            assert isinstance(address, int)

        def set_dst_device(self, address):
            assert isinstance(address, int)

        def __call__(self, aligned=False):
            assert self.height > 0 and self.width_in_bytes <= self.dst_pitch

    class Context:
        @staticmethod
        def synchronize():
            pass

        @staticmethod
        def pop():
            pass

        @staticmethod
        def push():
            pass

    class Error(Exception):
        pass

    @staticmethod
    def memcpy_htod_async(address, array, stream):
        assert isinstance(address, int) and array.dtype in (np.uint8, np.int32)

    @staticmethod
    def memcpy_dtoh_async(array, address, stream):
        assert isinstance(address, int)

    @staticmethod
    def memcpy_dtod(dst, src, size):
        assert isinstance(dst, int) and isinstance(src, int) and size > 0

    @staticmethod
    def memset_d32(address, value, count):
        assert isinstance(address, int) and count > 0

    memset_d8 = memset_d32

    @staticmethod
    def memset_d8_async(address, value, count, stream=None):
        assert isinstance(address, int) and count > 0


class TypedRecorder(Recorder):
    """A Recorder that also checks each argument against its C type: pointers and ints are Python ints."""

    def __missing__(self, name):
        record = super().__missing__(name)

        def launch(grid, block, stream, *args, shared_bytes=None):
            for letter, arg in zip(SIGNATURES[name].arg_format, args):
                assert isinstance(arg, (int, float) if letter == "f" else int) and not isinstance(arg, bool), \
                    (name, letter, arg)
            record(grid, block, stream, *args, shared_bytes=shared_bytes)
        return launch


class FakeDevice:
    """Stands in for device.Device: addresses handed out in order, kernels recorded."""

    name, num_sms, l2_bytes, closed, kernel_wait = "stand-in", 132, 50 << 20, False, 0.0
    context = FakeDriver.Context

    def __init__(self, kernels):
        self.kernels, self.next, self.live = kernels, 1 << 20, {}
        self.prepared: list[str] | None = None

    def prepare_kernels(self, names):
        self.prepared = list(names)

    def empty(self, dtype, shape):
        tensor = DeviceTensor(self.next, dtype, tuple(shape))
        self.next += -(-max(tensor.nbytes, 1) // 256) * 256
        self.live[tensor.ptr] = tensor
        return tensor

    def upload(self, array, dtype):
        assert array.dtype == np.dtype({"f32": np.float32, "u64": np.uint64, "i32": np.int32, "bf16": np.uint16}[dtype])
        return self.empty(dtype, array.shape)

    def free(self, memory):
        del self.live[memory.ptr if isinstance(memory, DeviceTensor) else memory]

    def pinned(self, size, dtype):
        return np.zeros(size, dtype)

    def free_pinned(self, array):
        pass

    def mem_get_info(self):
        return 1 << 40, 1 << 40

    def cublas(self, stream, workspace, exact_rows=frozenset(), algos=None, invariant=False):
        return RecordingBlas(invariant)

    def ops(self, stream):
        return Ops(self.kernels, stream, self.num_sms)

    def release(self, closable):
        closable.close()

    def alloc(self, size):
        return self.empty("u8", (size,)).ptr

    def stream(self, non_blocking=False):
        return FakeStream()

    def check_open(self):
        if self.closed:
            raise RuntimeError("closed")

    def own(self, closable, worker=False):
        return closable

    def close(self):
        self.closed = True
        self.live.clear()


class FakeStream:
    handle = 0

    def synchronize(self):
        pass


class FakeBuffers:
    def ptr(self, name, index=0):
        return 0x7000_0000 + 4 * index


@pytest.fixture
def forward_module(monkeypatch):
    """backends/cuda/forward.py imported against FakeDriver (and dropped again afterwards)."""
    import importlib
    import sys
    import types

    import tinyvllm.backends.cuda as package

    fake = types.ModuleType("pycuda")
    fake.driver = FakeDriver
    monkeypatch.setitem(sys.modules, "pycuda", fake)
    monkeypatch.setitem(sys.modules, "pycuda.driver", FakeDriver)
    names = ("forward", "weights", "device", "graphs", "runner")
    saved = {name: getattr(package, name) for name in names if hasattr(package, name)}
    for name in names:
        monkeypatch.delitem(sys.modules, f"tinyvllm.backends.cuda.{name}", raising=False)
    yield importlib.import_module("tinyvllm.backends.cuda.forward")
    for name in names:
        sys.modules.pop(f"tinyvllm.backends.cuda.{name}", None)
        if hasattr(package, name):
            delattr(package, name)
    for name, module in saved.items():
        setattr(package, name, module)


@pytest.mark.parametrize("architecture,kv_cache_dtype", [("LlamaForCausalLM", "auto"), ("Qwen2ForCausalLM", "auto"),
                                                          ("Qwen3ForCausalLM", "fp8")])
def test_forward_launches_every_kernel_with_arguments_of_its_c_types(forward_module, architecture, kv_cache_dtype):
    """The whole forward on a stand-in device: every launch has its kernel's argument count and types, the GEMMs
    get device tensors of the weights' shapes, and the family's extras launch where it has them."""
    from tinyvllm.config import EngineConfig
    from tinyvllm.model.dummy import random_weights, tiny_config
    from tinyvllm.model.loader import LoadedModel

    config = tiny_config(head_dim=64, architecture=architecture)
    engine = EngineConfig(block_size=16, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=128,
                          num_kv_blocks=8, kv_cache_dtype=kv_cache_dtype)
    recorder = TypedRecorder()
    device = FakeDevice(recorder)
    forward = forward_module.CudaForward(LoadedModel(config, random_weights(config), None, "random"), engine, device,
                                         FakeStream(), 16)
    assert forward.layers[0].qkv.shape == (512, 64) and forward.layers[0].gate_up.shape == (256, 64)
    assert (forward.layers[0].qkv_bias is not None) == (architecture == "Qwen2ForCausalLM")
    assert (forward.layers[0].q_norm is not None) == (architecture == "Qwen3ForCausalLM")
    forward.allocate_kv_cache(8)
    forward.allocate_kv_cache(8)  # the first cache freed, not leaked
    assert sum(t.ptr == forward.kv.memory.ptr for t in device.live.values()) == 1
    buffers = FakeBuffers()
    forward.tune_lm_head([1, 2, 4])
    forward.decode(4, buffers, buffers, buffers)
    decode = [name for name, _, _ in recorder.launches]
    forward.prefill(10, buffers, buffers, 3, 2)
    forward.norm_sample_rows(1, buffers.ptr("rows"), 2)
    forward.compute_logits(2, forward.buf.sample_hidden)
    forward.sample_prefill(2, buffers, buffers, buffers, masks=buffers)
    forward.prompt_logprobs(3, buffers.ptr("rows"), buffers.ptr("targets"), 5, (buffers.ptr("lp"), 8, 12))
    forward.copy_blocks(buffers.ptr("pairs"), 2)
    forward.init_token_slots(1, 2, 3, 4, 5)
    fp8 = "fp8_" if kv_cache_dtype == "fp8" else ""
    rope = f"rope_and_cache_{fp8 or 'bf16_'}"[:-1]  # Qwen3's q/k norms fused in (heads of 64: 8 lanes each)
    per_layer = ["rms_norm", "gemv_bf16", *(["add_qkv_bias"] if architecture == "Qwen2ForCausalLM" else []), rope,
                 f"attention_decode_{fp8}d64_r8", "attention_combine", "gemv_f32", "rms_norm", "gemv_swiglu_bf16",
                 "gemv_f32"]
    # 4 rows: each sampled by a cluster of SAMPLING_SPLIT blocks
    assert decode == ["resolve_tokens", "embedding", *per_layer * 2, "rms_norm", "gemv_f32",
                      "apply_logits_processors", "sample_split", "count_tokens"]
    assert recorder.launches[decode.index("sample_split")][1] == (4 * ops.SAMPLING_SPLIT,)
    rope_args = next(a for (name, _, _), a in zip(recorder.launches, recorder.args) if name == rope)
    layer = forward.layers[0]
    norms = (layer.q_norm.ptr, layer.k_norm.ptr, config.rms_norm_eps) if layer.q_norm is not None else (0, 0, 0.0)
    assert rope_args[11:14] == pytest.approx(norms)
    blas = forward.linear.blas.calls  # the prefill's 10 rows: cuBLAS, each with a weight of the layer
    assert [w.shape for _, _, w, m, _ in blas[:4]] == [(512, 64), (64, 256), (256, 64), (64, 128)]
    assert all(m == 10 for _, _, _, m, _ in blas[:8])
    other = forward.on_stream(FakeStream())
    assert other.buf is forward.buf and other.linear.blas is not forward.linear.blas
    other.close()


# The layer ops Gemma 2 and 3 and Phi-3 add (their windows, attention soft cap and RoPE variants left out)
GEMMA_LAYER_FAMILIES = {
    "Gemma2ForCausalLM": dict(activation="gelu_pytorch_tanh", final_logit_softcapping=30.0, tie_word_embeddings=True),
    "Gemma3ForCausalLM": dict(activation="gelu_pytorch_tanh", tie_word_embeddings=True),
    "Gemma3ForConditionalGeneration": dict(activation="gelu_pytorch_tanh", tie_word_embeddings=True),
    "Phi3ForCausalLM": dict(),
}


@pytest.mark.parametrize("architecture", list(GEMMA_LAYER_FAMILIES))
def test_forward_runs_the_gemma_and_phi3_layer_ops(forward_module, architecture):
    """Gemma's (1 + weight) norms, scaled embeddings, sandwich norms (the O and down GEMMs into a float32 scratch,
    then rms_norm_residual), GeGLU and final-logit soft cap, and Phi-3's fused qkv_proj / gate_up_proj uploaded into
    the packed layout: the launches, their C types and their float arguments, on a stand-in device."""
    from tinyvllm.backends.base import missing_cuda_kernels
    from tinyvllm.config import EngineConfig
    from tinyvllm.model.dummy import random_weights, tiny_config
    from tinyvllm.model.loader import LoadedModel

    config = tiny_config(head_dim=64, architecture=architecture, **GEMMA_LAYER_FAMILIES[architecture])
    assert missing_cuda_kernels(config, 128) is None
    engine = EngineConfig(block_size=16, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=128,
                          num_kv_blocks=8)
    recorder = TypedRecorder()
    forward = forward_module.CudaForward(LoadedModel(config, random_weights(config), None, "random"), engine,
                                         FakeDevice(recorder), FakeStream(), 16)
    gemma = architecture.startswith("Gemma")
    assert forward.layers[0].qkv.shape == (512, 64) and forward.layers[0].gate_up.shape == (256, 64)
    assert (forward.layers[0].attn_out_norm is not None) == gemma and (forward.buf.part is not None) == gemma
    assert (forward.layers[0].q_norm is not None) == architecture.startswith("Gemma3")
    assert forward.lm_head is forward.embed if gemma else forward.lm_head is not forward.embed
    forward.allocate_kv_cache(8)
    buffers = FakeBuffers()
    forward.decode(4, buffers, buffers, buffers)
    names = [name for name, _, _ in recorder.launches]
    if gemma:  # Gemma 3's q/k norms: fused into rope_and_cache
        per_layer = ["rms_norm", "gemv_bf16", "rope_and_cache_bf16", "attention_decode_d64_r8",
                     "attention_combine", "gemv_f32", "rms_norm_residual", "gemv_geglu_bf16", "gemv_f32",
                     "rms_norm_residual"]
    else:
        per_layer = ["rms_norm", "gemv_bf16", "rope_and_cache_bf16", "attention_decode_d64_r8", "attention_combine",
                     "gemv_f32", "rms_norm", "gemv_swiglu_bf16", "gemv_f32"]
    cap = ["soft_cap"] * (architecture == "Gemma2ForCausalLM")
    assert names == ["resolve_tokens", "embedding", *per_layer * 2, "rms_norm", "gemv_f32", *cap,
                     "apply_logits_processors", "sample_split", "count_tokens"]
    args = {name: a for (name, _, _), a in zip(recorder.launches, recorder.args)}
    assert args["embedding"][-1] == (8.0 if gemma else 1.0)  # sqrt(hidden 64)
    assert args["rms_norm"][-1] == (1.0 if gemma else 0.0)
    if gemma:
        assert args["rms_norm_residual"][0] == 0 and args["rms_norm_residual"][-1] == 1.0  # the MLP's: no next norm
        outputs = [a[0] for (name, _, _), a in zip(recorder.launches, recorder.args) if name == "rms_norm_residual"]
        assert outputs[0] == forward.buf.h.ptr  # after the attention: the MLP's input, normed
    if cap:
        assert args["soft_cap"] == (forward.buf.logits.ptr, config.vocab_size, 30.0)
    forward.prefill(10, buffers, buffers, 3, 2)  # cuBLAS: GeGLU after the gate/up GEMM
    assert ("gelu_tanh_and_mul" in [name for name, _, _ in recorder.launches]) == gemma


def test_forward_quantizes_the_layer_weights_to_fp8(forward_module):
    """quantization="fp8" on a stand-in device: each layer's linear weights become e4m3 with a float32 scale per
    output channel (the bf16 weights freed), the embedding and LM head stay bf16, and a step's linear layers
    run the FP8 GEMVs (decode: they quantize their input themselves) or quantize their input, then cuBLASLt's FP8
    GEMM and scale_rows_cols (prefill)."""
    from tinyvllm.config import EngineConfig
    from tinyvllm.model.dummy import random_weights, tiny_config
    from tinyvllm.model.loader import LoadedModel

    config = tiny_config(head_dim=64)
    engine = EngineConfig(block_size=16, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=128,
                          num_kv_blocks=8, quantization="fp8")
    recorder = TypedRecorder()
    device = FakeDevice(recorder)
    forward = forward_module.CudaForward(LoadedModel(config, random_weights(config), None, "random"), engine, device,
                                         FakeStream(), 16)
    for layer in forward.layers:
        for field in ("qkv", "o", "gate_up", "down"):
            w = getattr(layer, field)
            assert w.dtype == E4M3 and w.scale.dtype == F32 and w.scale.shape == w.shape[:1], field
            assert w.ptr in device.live and w.scale.ptr in device.live
        assert layer.input_norm.dtype == BF16
    assert forward.embed.dtype == forward.lm_head.dtype == BF16
    quantized = [args for (name, _, _), args in zip(recorder.launches, recorder.args) if name == "quantize_fp8"]
    assert len(quantized) == 4 * config.num_hidden_layers
    weight_shapes = {getattr(forward.layers[0], field).shape for field in ("qkv", "o", "gate_up", "down")}
    kept = {forward.embed.ptr, forward.lm_head.ptr}  # of the shape of qkv here
    assert not [t for t in device.live.values()
                if t.dtype == BF16 and t.shape in weight_shapes and t.ptr not in kept]  # the bf16 ones freed
    forward.allocate_kv_cache(8)
    recorder.launches.clear()
    recorder.args.clear()
    buffers = FakeBuffers()
    forward.decode(4, buffers, buffers, buffers)
    # the parts' merge writes O's input quantized (no quantize_fp8_values of its own); the activation's is one
    per_layer = ["rms_norm", "gemv_fp8_bf16", "rope_and_cache_bf16", "attention_decode_d64_r8",
                 "attention_combine_quantize_values", "gemv_fp8_f32", "rms_norm", "gemv_swiglu_fp8",
                 "quantize_fp8_values", "gemv_fp8_f32"]
    assert [name for name, _, _ in recorder.launches] == ["resolve_tokens", "embedding", *per_layer * 2, "rms_norm",
                                                          "gemv_f32", "apply_logits_processors", "sample_split",
                                                          "count_tokens"]
    launches = list(zip([name for name, _, _ in recorder.launches], recorder.args))
    for i, (name, args) in enumerate(launches):
        if name == "attention_combine_quantize_values":  # O's GEMV reads its codes and scales
            o_args = launches[i + 1][1]
            assert launches[i + 1][0] == "gemv_fp8_f32" and (o_args[1], o_args[4]) == (args[0], args[1])
    recorder.launches.clear()
    forward.prefill(10, buffers, buffers, 3, 2)
    assert [name for name, _, _ in recorder.launches].count("scale_rows_cols_f32") == 2 * config.num_hidden_layers
    assert all(x.dtype == E4M3 and out.dtype == F32 for out, x, _, _, _ in forward.linear.blas.calls)
    assert forward.on_stream(FakeStream()).linear.fp8 is forward.linear.fp8


class MemoryDevice(FakeDevice):
    """FakeDevice with `free` bytes of memory: the most its allocations held at once (`peak`), and
    mem_get_info's answer."""

    def __init__(self, kernels, free):
        super().__init__(kernels)
        self.free_bytes, self.held, self.peak = free, 0, 0

    def empty(self, dtype, shape):
        tensor = super().empty(dtype, shape)
        self.held += tensor.nbytes
        self.peak = max(self.peak, self.held)
        return tensor

    def free(self, memory):
        self.held -= self.live[memory.ptr if isinstance(memory, DeviceTensor) else memory].nbytes
        super().free(memory)

    def mem_get_info(self):
        return self.free_bytes - self.held, 1 << 40


def test_bf16_weights_upload_without_waiting_for_the_kernels(forward_module):
    """Streaming a bf16 checkpoint launches no kernel, so the upload never asks for the launchers (Device.ops waits
    for the model's kernels to be built, which goes on beside the upload); FP8 weights ask at their first
    quantize_fp8."""
    import importlib

    from tinyvllm.config import EngineConfig
    from tinyvllm.model.dummy import random_weights, tiny_config
    from tinyvllm.model.loader import LoadedModel

    weights_module = importlib.import_module("tinyvllm.backends.cuda.weights")
    config = tiny_config(head_dim=64)
    model = LoadedModel(config, random_weights(config), None, "random")

    class NoKernelsYet(FakeDevice):
        asked = 0

        def ops(self, stream):
            self.asked += 1
            return super().ops(stream)

    for quantization, asked in ((None, False), ("fp8", True)):
        device = NoKernelsYet(TypedRecorder())
        uploader = weights_module.WeightUploader(model, EngineConfig(quantization=quantization), device, FakeStream())
        uploader.upload(model.weights)
        assert bool(device.asked) == asked and len(uploader.layers) == config.num_hidden_layers


@pytest.mark.parametrize("dummy", [False, True])
def test_fp8_weights_load_layer_by_layer_where_bf16_would_not_fit(forward_module, monkeypatch, dummy):
    """quantization="fp8" makes each layer's weights e4m3 before the next layer's arrive (made on the device, or
    streamed from the host): the weights load into memory that holds their FP8 form and one layer's bf16 form,
    less than the bf16 model; the bf16 model is refused there in one MemoryError, which says what FP8 would need
    (and does not where FP8 would not fit either)."""
    from tinyvllm.config import EngineConfig
    from tinyvllm.model.dummy import RandomBf16Weights, random_weights, tiny_config
    from tinyvllm.model.loader import LoadedModel, weight_shapes
    from tinyvllm.model.weights import layer_parts

    config = tiny_config(head_dim=64, num_hidden_layers=6, hidden_size=512, intermediate_size=2048)
    shapes = weight_shapes(config)
    bf16 = sum(2 * math.prod(shape) for shape in shapes.values())
    quantized = {name for i in range(6) for field in ("qkv", "o", "gate_up", "down")
                 for name in layer_parts(config, i)[field]}
    fp8 = bf16 - sum(math.prod(shapes[name]) for name in quantized)
    layer = sum(2 * math.prod(shapes[name]) for name in quantized) // 6  # the e4m3 fields' bf16 bytes a layer
    gate_up = sum(2 * math.prod(shapes[name]) for name in layer_parts(config, 0)["gate_up"])  # its interleave
    free = fp8 + layer + gate_up + (1 << 20)  # and room for the scales and the buffers
    assert free < bf16
    weights = RandomBf16Weights(config) if dummy else random_weights(config)
    engine = dict(block_size=16, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=128, num_kv_blocks=8)
    recorder = TypedRecorder()
    device = MemoryDevice(recorder, free)
    loaded = []  # the peak when the weights are there, before the step buffers (the cuBLAS workspace: 32 MiB)
    allocate = forward_module.CudaForward._allocate_buffers
    monkeypatch.setattr(forward_module.CudaForward, "_allocate_buffers",
                        lambda self: (loaded.append(device.peak), allocate(self)))
    forward = forward_module.CudaForward(LoadedModel(config, weights, None, "random"),
                                         EngineConfig(**engine, quantization="fp8"), device, FakeStream(), 16)
    assert all(getattr(layer, field).dtype == E4M3 for layer in forward.layers for field in ("qkv", "o", "down"))
    assert fp8 < loaded[0] <= free
    names = [name for name, _, _ in recorder.launches]
    launches = list(zip(names, recorder.args))
    made = [args[0] for name, args in launches if name == "random_bf16"]  # each part's address
    quantized = [(i, args) for i, (name, args) in enumerate(launches) if name == "quantize_fp8"]
    finals = [(getattr(layer, field).ptr, getattr(layer, field).scale.ptr) for layer in forward.layers
              for field in ("qkv", "o", "gate_up", "down")]
    assert [(args[0], args[1]) for _, args in quantized] == finals  # each into the layer's codes and scales
    if dummy:  # from the bf16 weight just made, before the next layer's weights are
        for i, args in quantized:
            assert args[2] in made[:sum(name == "random_bf16" for name in names[:i])]
        assert quantized[0][0] < len(names) - names[::-1].index("random_bf16") - 1
    fp8_line = (r"GiB free; in FP8 \(quantization=\"fp8\", --quantization fp8\) they would need "
                rf"{fp8 / (1 << 30):.2f} GiB$")
    with pytest.raises(MemoryError, match=r"the model's weights need [0-9.]+ GiB .* but the GPU .* " + fp8_line):
        forward_module.CudaForward(LoadedModel(config, weights, None, "random"), EngineConfig(**engine),
                                   MemoryDevice(TypedRecorder(), free), FakeStream(), 16)
    with pytest.raises(MemoryError, match=r"GiB free$"):  # nor in FP8
        forward_module.CudaForward(LoadedModel(config, weights, None, "random"), EngineConfig(**engine),
                                   MemoryDevice(TypedRecorder(), fp8), FakeStream(), 16)


@pytest.mark.parametrize("tied", [False, True])
def test_forward_quantizes_the_lm_head_to_fp8(forward_module, tied):
    """quantize_lm_head on a stand-in device: the LM head becomes e4m3 with a scale per vocabulary row (a tied one
    gets codes of its own, the bf16 embedding kept for the lookup; an untied one's bf16 rows freed), is not tuned
    (cuBLASLt's FP8 path), and runs as gemv_fp8 at decode and as cuBLASLt's FP8 GEMM written into the float32
    logits themselves beyond 8 rows, scaled there (the scratch accumulator is not sized for the vocabulary)."""
    from tinyvllm.config import EngineConfig
    from tinyvllm.model.dummy import random_weights, tiny_config
    from tinyvllm.model.loader import LoadedModel

    config = tiny_config(head_dim=64, tie_word_embeddings=tied)
    engine = EngineConfig(block_size=16, max_num_seqs=16, max_num_batched_tokens=16, max_model_len=128,
                          num_kv_blocks=8, quantization="fp8", quantize_lm_head=True)
    recorder = TypedRecorder()
    device = FakeDevice(recorder)
    forward = forward_module.CudaForward(LoadedModel(config, random_weights(config), None, "random"), engine, device,
                                         FakeStream(), 16)
    head = forward.lm_head
    assert head.dtype == E4M3 and head.shape == (config.vocab_size, config.hidden_size)
    assert head.scale.shape == (config.vocab_size,) and head.ptr in device.live and head.scale.ptr in device.live
    assert forward.embed.dtype == BF16 and forward.embed.ptr in device.live
    bf16_heads = [t for t in device.live.values() if t.dtype == BF16 and t.shape == head.shape]
    assert bf16_heads == [forward.embed]  # tied: the embedding itself; untied: the bf16 LM head freed
    assert forward.tune_lm_head([1, 8, 16]) == {}
    forward.allocate_kv_cache(8)
    recorder.launches.clear()
    forward.compute_logits(4, forward.buf.sample_hidden)
    assert [name for name, _, _ in recorder.launches] == ["quantize_fp8_values", "gemv_fp8_f32"]
    recorder.launches.clear()
    calls = len(forward.linear.blas.calls)
    forward.compute_logits(16, forward.buf.sample_hidden)
    assert [name for name, _, _ in recorder.launches] == ["quantize_fp8", "scale_rows_cols_f32"]
    out, x, w, m, _ = forward.linear.blas.calls[calls]
    assert out.ptr == forward.buf.logits.ptr and x.dtype == E4M3 and w is head and m == 16
    scale_args = recorder.args[-1]
    assert scale_args[0] == scale_args[1] == forward.buf.logits.ptr and scale_args[-1] == 0  # in place, no add


@pytest.mark.parametrize("scheme,blocks", [("fp8-tensor", True), ("fp8-block", True), ("fp8-block", False),
                                           ("ct-channel", True)])
def test_an_fp8_checkpoint_goes_to_the_gpu_as_stored_or_requantized_per_channel(forward_module, tmp_path,
                                                                                 monkeypatch, scheme, blocks):
    """An FP8 checkpoint on a stand-in device: with a scale per tensor or per channel its e4m3 codes are sent as the
    file stores them, each row with its scale (gate/up's rows and scales interleaved alike), and nothing is
    quantized; so are 128 x 128 block-scaled codes, with their block scales (rows padded to 4 blocks of columns,
    gate/up not interleaved), where cuBLASLt has block-scaled algorithms; else those weights stream dequantized,
    as bf16, and are quantized per output channel on the GPU, as quantization="fp8" does with a bf16
    checkpoint."""
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file
    from test_fp8_checkpoints import write_fp8_checkpoint

    from tinyvllm.config import EngineConfig
    from tinyvllm.model.loader import load_model

    path = write_fp8_checkpoint(tmp_path, scheme, head_dim=64)[0]
    model = load_model(path)
    sent, uploaded = {}, {}
    monkeypatch.setattr(forward_module.cuda, "memcpy_htod_async",
                        lambda address, array, stream: sent.setdefault(address, array.tobytes()))
    device = FakeDevice(TypedRecorder())
    upload = device.upload

    def recorded(array, dtype):
        tensor = upload(array, dtype)
        uploaded[tensor.ptr] = array.copy()
        return tensor

    device.upload = recorded
    monkeypatch.setattr(RecordingBlas, "blocks", blocks)
    engine = EngineConfig(block_size=16, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=128,
                          num_kv_blocks=8)
    forward = forward_module.CudaForward(model, engine, device, FakeStream(), 16)
    dtypes = {(i, field): getattr(layer, field).dtype for i, layer in enumerate(forward.layers)
              for field in ("qkv", "o", "gate_up", "down")}
    ignored = {(1, "down")} if scheme == "ct-channel" else set()  # its ignore list leaves layer 1's down float
    assert {key for key, dtype in dtypes.items() if dtype != E4M3} == ignored
    assert all(dtypes[key] == BF16 for key in ignored)
    quantized = [name for name, _, _ in device.kernels.launches].count("quantize_fp8")
    if scheme == "fp8-block" and not blocks:
        assert quantized == len(dtypes) - len(ignored) and not forward.block_codes
        return
    assert quantized == 0
    stored, layer = load_file(str(path / "model.safetensors")), forward.layers[0]
    assert sent[layer.qkv.ptr] == stored["model.layers.0.self_attn.q_proj.weight"].view(torch.uint8).numpy().tobytes()
    if scheme == "fp8-block":
        up = stored["model.layers.0.mlp.up_proj.weight"].view(torch.uint8).numpy().tobytes()
        assert sent[layer.gate_up.ptr + len(up)] == up  # gate's rows, then up's: not interleaved
        scales = [stored[f"model.layers.0.mlp.{part}_proj.weight_scale_inv"].numpy() for part in ("gate", "up")]
        padded = np.zeros((sum(len(s) for s in scales), 4), np.float32)
        padded[:, :scales[0].shape[1]] = np.concatenate(scales)
        np.testing.assert_array_equal(uploaded[layer.gate_up.scale.ptr], padded)
        return
    scale_name = "model.layers.0.mlp.{}_proj.weight_scale"
    gate, up = (np.broadcast_to(stored[scale_name.format(part)].numpy().reshape(-1), (128,)) for part in ("gate", "up"))
    interleaved = np.stack([gate.reshape(-1, 8), up.reshape(-1, 8)], 1).reshape(-1)
    np.testing.assert_array_equal(uploaded[layer.gate_up.scale.ptr], interleaved)
    assert layer.gate_up.scale.shape == (256,) and layer.qkv.scale.shape == (layer.qkv.shape[0],)


def test_a_block_scaled_fused_projection_not_whole_blocks_is_refused_on_cuda(forward_module, tmp_path):
    """K of 64 rows fused into QKV with 128 x 128 block scales: its blocks would mix parts, so the cuda backend
    refuses it in one line, as the numpy backend does (test_fp8_checkpoints)."""
    pytest.importorskip("torch")
    from test_fp8_checkpoints import write_fp8_checkpoint

    from tinyvllm.config import EngineConfig
    from tinyvllm.model.loader import load_model

    path, *_ = write_fp8_checkpoint(tmp_path, "fp8-block", head_dim=64, num_attention_heads=4, num_key_value_heads=1)
    engine = EngineConfig(block_size=16, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=128,
                          num_kv_blocks=8)
    with pytest.raises(ValueError, match="k_proj.weight has 64 rows: a fused projection's parts must have a multiple"):
        forward_module.CudaForward(load_model(path), engine, FakeDevice(TypedRecorder()), FakeStream(), 16)


def test_block_scales_of_a_partial_column_block_are_requantized(forward_module, tmp_path, caplog):
    """A block-scaled checkpoint whose hidden size is not whole 128-column blocks (QKV's and gate/up's k = 320):
    cuBLASLt's block-scaled products were measured on whole blocks only, so its weights are requantized with a
    scale per row, with a warning, as where cuBLASLt has no algorithm."""
    import logging

    pytest.importorskip("torch")
    from test_fp8_checkpoints import write_fp8_checkpoint

    from tinyvllm.config import EngineConfig
    from tinyvllm.model.loader import load_model

    model = load_model(write_fp8_checkpoint(tmp_path, "fp8-block", hidden_size=320, intermediate_size=256)[0])
    device = FakeDevice(TypedRecorder())
    engine = EngineConfig(block_size=16, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=128,
                          num_kv_blocks=8)
    with caplog.at_level(logging.WARNING, logger="tinyvllm"):
        forward = forward_module.CudaForward(model, engine, device, FakeStream(), 16)
    assert not forward.block_codes and "no block-scaled FP8 product for [512, 320]" in caplog.text
    assert forward.layers[0].qkv.scale.shape == (512,)
    assert [name for name, _, _ in device.kernels.launches].count("quantize_fp8") == 4 * model.config.num_hidden_layers


def graphs_module():
    """backends/cuda/graphs.py as forward_module imported it (against FakeDriver): where Graph is looked up."""
    import importlib

    return importlib.import_module("tinyvllm.backends.cuda.graphs")


class FakeGraph:
    """Stands in for driver.Graph: records by running `record` (its launches land in the Recorder)."""

    made = []

    def __init__(self, stream_handle, record):
        record()
        self.launches, self.closed = 0, False
        FakeGraph.made.append(self)

    def launch(self, stream_handle):
        assert not self.closed
        self.launches += 1

    def close(self):
        self.closed = True


def serve_every_feature(runner, model, engine_config, device, use_graphs: bool):
    """CudaBackend through the engine on `device`: a plain request and one with every sampling feature (two prefill
    chunks, n=2, logprobs, penalties, bias, allowed ids). Returns the backend and the kernels launched."""
    from tinyvllm import SamplingParams
    from tinyvllm.engine.llm_engine import LLMEngine

    backend = runner.CudaBackend(model, engine_config, use_graphs=use_graphs, device=device)
    engine = LLMEngine(model, backend, engine_config)
    backend.finish_startup()
    every = SamplingParams(max_tokens=3, temperature=0.8, ignore_eos=True, n=2, logprobs=2, prompt_logprobs=1,
                           presence_penalty=0.5, repetition_penalty=1.2, logit_bias={7: 2.0},
                           allowed_token_ids=list(range(100)))
    for i, (prompt, params) in enumerate([([1, 2, 3], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)),
                                          (list(range(5, 45)), every)]):  # the second prompt: two prefill chunks
        assert engine.add_request(str(i), prompt, params) is None
    while engine.has_unfinished_requests():
        engine.step()
    return backend, [name for name, _, _ in device.kernels.launches]


def engine_config_for(model, graphs: str | None, kv_cache_dtype: str = "auto", quantization: str | None = None):
    from tinyvllm.config import EngineConfig

    engine_config = EngineConfig(block_size=16, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128,
                                 num_kv_blocks=16, cuda_graph_capture=graphs or "lazy", kv_cache_dtype=kv_cache_dtype,
                                 quantization=quantization)
    return engine_config.for_model(model.config.max_position_embeddings)


@pytest.mark.parametrize("graphs", [None, "eager", "lazy"])
def test_the_backend_runs_steps_and_closes_on_a_stand_in_device(forward_module, make_model_dir, monkeypatch,
                                                                  graphs):
    """CudaBackend through the engine on FakeDevice (eagerly, or with graphs captured at start-up or by the capture
    thread): prefill and decode steps launch with arguments of their kernels' C types, and close() closes the
    graphs and the device, after which a step stops before touching memory."""
    import importlib

    from tinyvllm.model.loader import load_model

    runner = importlib.import_module("tinyvllm.backends.cuda.runner")
    monkeypatch.setattr(graphs_module(), "Graph", FakeGraph)
    FakeGraph.made = []
    model = load_model(make_model_dir(head_dim=64))
    device = FakeDevice(TypedRecorder())
    backend, names = serve_every_feature(runner, model, engine_config_for(model, graphs), device, graphs is not None)
    sampled = [name for name in names if name in ("sample", "sample_split")]
    assert len(sampled) >= 3 and any(name.startswith("attention_prefill") for name in names)
    assert any(name.startswith("attention_decode") for name in names)
    assert {"copy_blocks", "fill_token_slots", "apply_logits_processors"} <= set(names)
    assert {"logprobs", "logprobs_split"} & set(names)
    assert set(names) <= set(device.prepared)  # start-up built every kernel the steps launched
    if graphs is not None:
        assert sorted(backend.graphs.sampled) == backend.graphs.buckets and any(g.launches for g in FakeGraph.made)
    backend.close()
    backend.close()
    assert device.closed and device.live == {} and all(graph.closed for graph in FakeGraph.made)
    with pytest.raises(RuntimeError, match="closed"):
        backend.decode_in.wait()


def stand_in_engine(make_model_dir, monkeypatch):
    """A CudaBackend on FakeDevice (graphs captured at start-up, as FakeGraphs) under an LLMEngine, for a tiny
    model: (backend, engine)."""
    import importlib

    from tinyvllm.engine.llm_engine import LLMEngine
    from tinyvllm.model.loader import load_model

    runner = importlib.import_module("tinyvllm.backends.cuda.runner")
    monkeypatch.setattr(graphs_module(), "Graph", FakeGraph)
    model = load_model(make_model_dir(head_dim=64))
    engine_config = engine_config_for(model, "eager")
    backend = runner.CudaBackend(model, engine_config, device=FakeDevice(TypedRecorder()))
    return backend, LLMEngine(model, backend, engine_config)


def test_a_decode_step_moves_its_inputs_and_its_outputs_in_one_copy_each(forward_module, make_model_dir,
                                                                          monkeypatch):
    """On the stand-in device, decode steps whose rows ask penalties and logprobs (half of them: a logprob row
    list): each step's inputs (tokens, sampling, the processors' rows, the logprob rows, block tables) go up in one
    copy, its sampled ids and their logprobs come back in one, and the host waits twice a step (for the inputs'
    buffer, for the outputs)."""
    import collections
    from tinyvllm import SamplingParams

    backend, engine = stand_in_engine(make_model_dir, monkeypatch)
    mixed = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=2, presence_penalty=0.5, repetition_penalty=1.1)
    for i in range(4):
        engine.add_request(str(i), [1 + i, 2, 3], mixed if i % 2 else SamplingParams(max_tokens=12, ignore_eos=True))
    for _ in range(3):  # the prefill, then decode
        engine.step()
    calls = collections.Counter()

    def counted(name, inner):
        def call(*args, **kwargs):
            calls[name] += 1
            return inner(*args, **kwargs)
        return call
    for name in ("memcpy_htod_async", "memcpy_dtoh_async"):
        monkeypatch.setattr(FakeDriver, name, staticmethod(counted(name, getattr(FakeDriver, name))))
    monkeypatch.setattr(FakeDriver.Event, "synchronize", counted("synchronize", FakeDriver.Event.synchronize))
    submitted = collections.Counter()
    submit = backend.submit
    monkeypatch.setattr(backend, "submit", lambda batch: (submitted.update([batch.max_query_len]), submit(batch))[1])
    for _ in range(5):
        engine.step()
    assert submitted == {1: 5}  # five decode steps
    assert calls == {"memcpy_htod_async": 5, "memcpy_dtoh_async": 5, "synchronize": 10}
    backend.close()


def test_a_decode_buckets_padding_rows_do_nothing(forward_module, make_model_dir, monkeypatch):
    """Three sequences in the 4-row decode bucket (one with penalties): the padding row gets each field's declared
    padding: token 0 at position 0, a one-token context, no cache slot, greedy, no processors, no last token."""
    from tinyvllm import SamplingParams

    backend, engine = stand_in_engine(make_model_dir, monkeypatch)
    for i, params in enumerate([SamplingParams(max_tokens=2, ignore_eos=True),
                                SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.7, top_p=0.5),
                                SamplingParams(max_tokens=8, ignore_eos=True, presence_penalty=0.5),
                                SamplingParams(max_tokens=8, ignore_eos=True)]):
        engine.add_request(str(i), [1 + i, 2, 3], params)
    buckets = []
    stage = backend._stage_decode
    monkeypatch.setattr(backend, "_stage_decode", lambda batch, bucket: (buckets.append((batch.num_seqs, bucket)),
                                                                         stage(batch, bucket))[1])
    while (3, 4) not in buckets:
        engine.step()
    inp = backend.decode_in
    row = {name: inp[name][3].item() for name in ("token_ids", "token_src", "positions", "slot_mapping",
                                                  "context_lens", "temperature", "top_p", "top_k", "penalty_slots",
                                                  "count_slots", "repetition", "last_src")}
    assert row == dict(token_ids=0, token_src=-1, positions=0, slot_mapping=-1, context_lens=1, temperature=0,
                       top_p=1, top_k=0, penalty_slots=-1, count_slots=-1, repetition=1, last_src=-1)
    assert (inp["penalty_slots"][:3] >= 0).sum() == 1 and np.isclose(inp["temperature"][:3], 0.7).sum() == 1
    backend.close()


@pytest.mark.parametrize("capture", ["eager", "lazy"])
def test_lists_outgrown_close_the_graphs_and_capture_them_again(forward_module, make_model_dir, monkeypatch,
                                                                 capture):
    """A step whose allowed ids outgrow the processor lists closes every decode graph (they read the old lists);
    lazy capture starts again and takes every bucket, eager capture takes each bucket at its next step."""
    import importlib

    from tinyvllm import SamplingParams
    from tinyvllm.engine.llm_engine import LLMEngine
    from tinyvllm.model.loader import load_model

    runner = importlib.import_module("tinyvllm.backends.cuda.runner")
    monkeypatch.setattr(graphs_module(), "Graph", FakeGraph)
    monkeypatch.setattr(runner, "PROCESSOR_LIST_ROWS", 8)
    FakeGraph.made = []
    model = load_model(make_model_dir(head_dim=64))
    engine_config = engine_config_for(model, capture)
    backend = runner.CudaBackend(model, engine_config, device=FakeDevice(TypedRecorder()))
    engine = LLMEngine(model, backend, engine_config)
    backend.finish_startup()
    before = list(FakeGraph.made)
    assert sorted(backend.graphs.sampled) == backend.graphs.buckets and backend.proc.allowed.size("allowed_ids") == 8
    engine.add_request("0", [1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True, allowed_token_ids=list(range(20))))
    while engine.has_unfinished_requests():
        engine.step()
    backend.finish_startup()
    assert backend.proc.allowed.size("allowed_ids") == 20 and all(graph.closed for graph in before)
    assert sorted(backend.graphs.sampled) == (backend.graphs.buckets if capture == "lazy" else [1])  # batch 1 ran
    assert (backend.graphs.capturer is not None) == (capture == "lazy")
    backend.close()


def test_a_dropped_backend_is_collected_at_once_with_its_capture_thread(forward_module, make_model_dir,
                                                                         monkeypatch):
    """The decode graphs and lazy capture's thread never hold the backend: one dropped is collected at once (no
    cycle waits for the collector), which closes its device and so stops the thread."""
    import gc
    import importlib
    import weakref

    from tinyvllm.model.loader import load_model

    runner = importlib.import_module("tinyvllm.backends.cuda.runner")
    monkeypatch.setattr(graphs_module(), "Graph", FakeGraph)
    model = load_model(make_model_dir(head_dim=64))
    device = FakeDevice(TypedRecorder())
    backend = runner.CudaBackend(model, engine_config_for(model, "lazy"), device=device)
    backend.init_kv_cache()
    capturer = backend.graphs.capturer
    assert capturer is not None
    gc.collect()
    gc.disable()
    try:
        ref = weakref.ref(backend)
        del backend
        assert ref() is None and device.closed
    finally:
        gc.enable()
    capturer.thread.join(timeout=10)
    assert not capturer.thread.is_alive()


def processing(n: int, allowed_ids: list[int] = ()):
    """A LogitsProcessing of n rows with penalties (slot i for row i, presence 0.5) and, on row 0, allowed_ids."""
    from tinyvllm.backends.base import LogitsProcessing

    allowed_ptr = np.full(n + 1, len(allowed_ids), np.int32)
    allowed_ptr[0] = 0
    return LogitsProcessing(
        penalty_slots=np.arange(n, dtype=np.int32), count_slots=np.arange(n, dtype=np.int32),
        presence=np.full(n, 0.5, np.float32), frequency=np.zeros(n, np.float32), repetition=np.ones(n, np.float32),
        allowed_ptr=allowed_ptr, allowed_ids=np.array(allowed_ids, np.int32), bias_ptr=np.zeros(n + 1, np.int32),
        bias_ids=np.zeros(0, np.int32), bias_values=np.zeros(0, np.float32), bias_cond=np.zeros(0, np.int32))


def test_processor_rows_go_back_to_padding_after_a_step_without_processors(forward_module):
    """A step without logits processors after one with pads every row of that step's inputs (not only the rows it
    runs): a later, larger step's padding rows count no sampled token into a sequence's slot."""
    import importlib

    runner = importlib.import_module("tinyvllm.backends.cuda.runner")
    device = FakeDevice(TypedRecorder())
    inp = runner.Staging(device, runner.processor_row_fields(8))
    buffers = runner.ProcessorBuffers(device, 16)
    buffers.reset(inp)
    n = 5
    proc = processing(n)
    buffers.stage(FakeStream(), inp, proc, np.arange(n, dtype=np.int32), np.full(n, -1, np.int32), 8)
    assert inp["count_slots"][:n].tolist() == list(range(n)) and (inp["count_slots"][n:] == -1).all()
    buffers.clear(inp)  # a step of 2 rows without processors
    assert (inp["count_slots"] == -1).all() and (inp["penalty_slots"] == -1).all()
    assert (inp["repetition"] == 1).all() and (inp["last_src"] == -1).all()
    inp["count_slots"][0] = 3  # cleared once: a later step without processors leaves the fields alone
    buffers.clear(inp)
    assert inp["count_slots"][0] == 3


def test_processors_staged_again_write_only_their_last_tokens(forward_module, monkeypatch):
    """The engine hands an unchanged decode run's steps the same LogitsProcessing: staged again into the same
    inputs for as many rows, only its rows' last tokens are written and its lists are not uploaded again; another
    one (or another row count) is written whole."""
    import importlib

    runner = importlib.import_module("tinyvllm.backends.cuda.runner")
    device = FakeDevice(TypedRecorder())
    inp = runner.Staging(device, runner.processor_row_fields(8))
    buffers = runner.ProcessorBuffers(device, 16)
    buffers.reset(inp)
    uploads = []
    monkeypatch.setattr(FakeDriver, "memcpy_htod_async", staticmethod(lambda address, array, stream:
                                                                       uploads.append(array.copy())))
    proc = processing(3, allowed_ids=[4, 9])
    last_src = np.full(3, -1, np.int32)
    buffers.stage(FakeStream(), inp, proc, np.array([5, 6, 7], np.int32), last_src, 4)
    assert len(uploads) == 1 and uploads[0].tolist() == [4, 9]
    inp["presence"][1] = 9.0  # a mark the next stage keeps only if it does not write the row fields
    buffers.stage(FakeStream(), inp, proc, np.array([8, 9, 10], np.int32), last_src, 4)
    assert inp["presence"][1] == 9.0 and inp["last_tokens"][:3].tolist() == [8, 9, 10] and len(uploads) == 1
    buffers.stage(FakeStream(), inp, proc, np.array([8, 9, 10], np.int32), last_src, 8)  # another bucket
    assert inp["presence"][1] == 0.5 and (inp["count_slots"][3:] == -1).all() and len(uploads) == 1
    inp["presence"][1] = 9.0
    other = processing(3, allowed_ids=[4, 9])
    buffers.stage(FakeStream(), inp, other, np.array([1, 2, 3], np.int32), last_src, 8)
    assert inp["presence"][1] == 0.5 and len(uploads) == 2


def test_sampling_parameters_handed_again_write_only_the_noise_keys(forward_module):
    """An unchanged decode run's steps hand the same sampling arrays: staged again for as many rows, only the noise
    keys are written; new arrays (or another row count) are written whole, with greedy padding."""
    import importlib

    from tinyvllm.backends.base import SamplingBatch

    runner = importlib.import_module("tinyvllm.backends.cuda.runner")
    backend = types.SimpleNamespace(sampling_staged={}, SAMPLING_PARAMS=runner.CudaBackend.SAMPLING_PARAMS)
    fill = runner.CudaBackend._fill_sampling
    inp = runner.Staging(FakeDevice(TypedRecorder()), runner.sampling_fields(8))
    params = dict(temperature=np.full(3, 0.7, np.float32), top_p=np.full(3, 0.9, np.float32),
                  top_k=np.full(3, 5, np.int32), min_p=np.zeros(3, np.float32))
    fill(backend, inp, SamplingBatch(**params, noise_keys=np.array([1, 2, 3], np.uint32)), 3, 4)
    assert inp["temperature"][:4].tolist() == pytest.approx([0.7, 0.7, 0.7, 0]) and inp["top_p"][3] == 1
    inp["top_k"][0] = 99  # kept only if the next fill does not write top_k
    fill(backend, inp, SamplingBatch(**params, noise_keys=np.array([4, 5, 6], np.uint32)), 3, 4)
    assert inp["top_k"][0] == 99 and inp["noise_keys"][:4].tolist() == [4, 5, 6, 0]
    fill(backend, inp, SamplingBatch(**params, noise_keys=np.array([4, 5, 6], np.uint32)), 3, 8)  # another bucket
    assert inp["top_k"][0] == 5 and inp["temperature"][7] == 0
    inp["top_k"][0] = 99
    fill(backend, inp, SamplingBatch(**{**params, "top_k": params["top_k"].copy()},
                                     noise_keys=np.zeros(3, np.uint32)), 3, 8)
    assert inp["top_k"][0] == 5


def test_packed_logprobs_lie_after_the_ids_and_read_back_as_written(forward_module):
    """PackedLogprobs: n rows of logprobs (top k) right after the ids field, in the order the pointers give, read
    back from a host copy as the kernel would have written them."""
    import importlib

    runner = importlib.import_module("tinyvllm.backends.cuda.runner")
    out = runner.Staging(FakeDevice(TypedRecorder()), {"ids": (8, np.int32), "logprobs": (8 * 9, np.int32)},
                         host_copies=2)
    n, k = 3, 4
    packed = runner.PackedLogprobs(n, k)
    token_lp, top_ids, top_lp = packed.ptrs(out)
    assert token_lp == out.ptr("ids", 8) and top_ids == token_lp + 4 * n and top_lp == top_ids + 4 * n * k
    assert packed.words == n * (1 + 2 * k)
    host = out.hosts[1]
    base = out.offsets["logprobs"]
    rng = np.random.default_rng(0)
    written = (rng.standard_normal(n).astype(np.float32), rng.integers(0, 100, (n, k)).astype(np.int32),
               rng.standard_normal((n, k)).astype(np.float32))
    for ptr, values in zip((token_lp, top_ids, top_lp), written):
        start = base + (ptr - out.ptr("logprobs")) // 4
        host[start: start + values.size] = values.ravel().view(np.int32)
    read = packed.read(out, 1)
    for got, want in zip((read.token_logprobs, read.top_ids, read.top_logprobs), written):
        assert got.dtype == want.dtype and np.array_equal(got, want)


@pytest.mark.parametrize("shape,kv_cache_dtype,attention", [
    (dict(head_dim=64), "auto", {"attention_decode_d64_r8", "attention_prefill_d64"}),
    (dict(head_dim=128, num_attention_heads=16, num_key_value_heads=1), "auto",
     {"attention_decode_d128_r16", "attention_prefill_d128"}),
    (dict(head_dim=64, architecture="Qwen3ForCausalLM"), "fp8", {"attention_decode_fp8_d64_r8",
                                                                 "attention_prefill_fp8_d64"}),
    (dict(head_dim=128, architecture="Qwen2ForCausalLM"), "auto", {"attention_decode_d128_r8",
                                                                   "attention_prefill_d128"})])
@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_start_up_builds_only_the_kernels_the_model_launches(forward_module, make_model_dir, monkeypatch, shape,
                                                             kv_cache_dtype, attention, quantization):
    """The backend prepares needed_kernels of its model's shapes: every kernel its steps launch (eager and
    captured), and of the attention kernels' instances only its head dim's, KV cache dtype's and decode tile's."""
    import importlib

    from tinyvllm.backends.cuda.kernels import COMBINE_QUANTIZE_KERNELS, needed_kernels
    from tinyvllm.backends.cuda.ops import SIGNATURES
    from tinyvllm.model.loader import load_model

    runner = importlib.import_module("tinyvllm.backends.cuda.runner")
    monkeypatch.setattr(graphs_module(), "Graph", FakeGraph)
    model = load_model(make_model_dir(**shape))
    device = FakeDevice(TypedRecorder())
    engine_config = engine_config_for(model, "eager", kv_cache_dtype, quantization)
    backend, names = serve_every_feature(runner, model, engine_config, device, True)
    backend.close()
    assert set(names) <= set(device.prepared)
    cfg = model.config
    assert device.prepared == needed_kernels(cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads,
                                             kv_cache_dtype == "fp8", quantization == "fp8")
    chosen = {name for name in device.prepared if name.startswith(("attention_decode_", "attention_prefill_"))}
    assert chosen == attention and attention <= set(names)
    fp8 = {name for name, signature in SIGNATURES.items() if signature.file == "fp8"}
    geglu = {name for name in SIGNATURES if name.startswith("gemv_geglu_")}  # another activation's GEMVs
    # the FP8 weights' kernels run (the pipelined GEMVs at wider k; those of block scales only for block-scaled
    # checkpoints), or are not built
    blocks = {name for name in fp8 if "_block" in name or "_groups" in name}
    ran = {name for name in fp8 - geglu - blocks if not name.endswith("_pipelined")}
    assert (ran <= set(names)) == (quantization == "fp8") and not (fp8 & set(names) and quantization is None)
    assert not blocks & set(names)
    experts = {name for name, signature in SIGNATURES.items() if signature.file == "moe"}
    assert set(SIGNATURES) - set(device.prepared) == {
        name for name in SIGNATURES if name.startswith(("attention_decode_", "attention_prefill_"))} - attention | (
        set() if quantization else fp8 | COMBINE_QUANTIZE_KERNELS) | geglu | experts | {"attention_combine_inv"}


class FakePycuda:
    """Stands in for pycuda.driver where device.py uses it: allocations that count their frees, a context stack."""

    def __init__(self):
        self.stack, self.freed, self.next = [], [], 1 << 20

    def init(self):
        pass

    @property
    def Device(self):
        fake = self

        class Device:
            @staticmethod
            def count():
                return 1

            def __init__(self, index):
                pass

            def name(self):
                return "stand-in"

            def compute_capability(self):
                return (9, 0)

            def get_attribute(self, attribute):
                return 132

            def retain_primary_context(self):
                return types.SimpleNamespace(push=lambda: fake.stack.append("primary"), synchronize=lambda: None)
        return Device

    device_attribute = types.SimpleNamespace(MULTIPROCESSOR_COUNT=16)

    @property
    def Context(self):
        fake = self
        return types.SimpleNamespace(synchronize=lambda: None, pop=lambda: fake.stack.pop())

    def mem_alloc(self, size):
        address, self.next = self.next, self.next + size
        fake = self

        class Allocation:
            def __int__(self):
                return address

            def free(self):
                fake.freed.append(address)
        return Allocation()

    def pagelocked_empty(self, size, dtype):
        fake = self

        class Pinned(np.ndarray):
            def free(self):
                fake.freed.append("pinned")
        return Pinned((size,), dtype).view(np.ndarray)  # its base, the Pinned, owns the memory

    def memcpy_htod(self, address, array):
        pass

    class Stream:
        handle = 3

        def __init__(self, flags=0):
            self.flags = flags

    def mem_get_info(self):
        return 1 << 30, 1 << 31


@pytest.fixture
def device_module(monkeypatch):
    """backends/cuda/device.py imported against FakePycuda (dropped again afterwards)."""
    import importlib
    import sys

    import tinyvllm.backends.cuda as package

    fake = FakePycuda()
    monkeypatch.setitem(sys.modules, "pycuda", types.SimpleNamespace(driver=fake))
    monkeypatch.setitem(sys.modules, "pycuda.driver", fake)
    saved = getattr(package, "device", None)
    monkeypatch.delitem(sys.modules, "tinyvllm.backends.cuda.device", raising=False)
    module = importlib.import_module("tinyvllm.backends.cuda.device")
    yield module, fake
    sys.modules.pop("tinyvllm.backends.cuda.device", None)
    if saved is not None:
        package.device = saved


class FakeKernelTable(dict):
    """Stands in for kernels.KernelTable: records what it was asked to load; its modules are 5 and 6."""

    def __init__(self, arch, programmatic):
        super().__init__(k=(arch, programmatic))
        self.loaded, self.modules = [], {"a": 5, "b": 6}

    def load(self, names=None):
        self.loaded.append(names)


def test_device_close_gives_back_everything_it_handed_out(device_module, monkeypatch):
    import atexit
    import threading

    module, fake = device_module
    unloaded, closed = [], []
    monkeypatch.setattr(module.kernels, "KernelTable", FakeKernelTable)
    monkeypatch.setattr(module.driver, "unload_module", unloaded.append)
    monkeypatch.setattr(module, "Cublas", lambda *args, **kwargs: types.SimpleNamespace(
        close=lambda: closed.append("cublas")))
    registered = []
    monkeypatch.setattr(atexit, "register", registered.append)
    monkeypatch.setattr(atexit, "unregister", registered.remove)

    device = module.Device(0, programmatic_launch=True)
    assert fake.stack == ["primary"] and device.kernels == {"k": ("sm_90", True)} and device.num_sms == 132
    assert device.kernels.loaded == [None]  # every kernel, once
    a, w = device.alloc(100), device.upload(np.zeros((4, 8), np.uint16), "bf16")
    device.empty("f32", (3, 3))
    with pytest.raises(TypeError, match="bf16 device tensor is uploaded from uint16, not float32"):
        device.upload(np.zeros(3, np.float32), "bf16")
    device.free(a)
    assert fake.freed == [a] and device.allocated_bytes == 64 + 36
    pinned = [device.pinned(16, np.int32) for _ in range(2)]
    device.free_pinned(pinned[0])
    blas = device.cublas(device.stream(), w)
    device.release(blas)
    device.cublas(device.stream(), w)
    worker = types.SimpleNamespace(close=lambda: closed.append("worker"))
    device.own(worker, worker=True)
    assert device.ops(None) is device.ops(None)
    device.close()
    assert closed == ["cublas", "worker", "cublas"]  # the worker stopped before the handles go
    assert sorted(map(str, fake.freed)) == sorted(map(str, [a, w.ptr, w.ptr + 64, "pinned", "pinned"]))
    assert unloaded == [5, 6] and fake.stack == [] and registered == [] and device.allocated_bytes == 0
    device.close()  # idempotent
    with pytest.raises(module.DeviceClosedError, match="was closed"):
        device.alloc(1)

    other = module.Device(0)
    thread = threading.Thread(target=other.close)  # closed from another thread: its own push and pop there
    thread.start()
    thread.join()
    assert other.closed and fake.stack == ["primary"]  # the main thread's push, left for the main thread: at exit
    [pop_at_exit] = registered
    pop_at_exit()
    assert fake.stack == []


@pytest.mark.parametrize("fails,at_open", [(False, False), (False, True), (True, False)])
def test_prepared_kernels_build_meanwhile_and_are_waited_for_at_first_use(device_module, monkeypatch, fails, at_open):
    """prepare_kernels (or Device's `prepare`, before the context is made) hands the names to a build that runs
    while the caller goes on; the kernels property waits for it (the time is kernel_wait), then loads those kernels
    only; a failed build raises there."""
    import threading
    from concurrent.futures import Future

    module, fake = device_module
    monkeypatch.setattr(module.kernels, "KernelTable", FakeKernelTable)
    builds = []

    def build_in_background(arch, names):
        future = Future()
        builds.append((arch, names, list(fake.stack)))
        threading.Timer(0.2, lambda: future.set_exception(RuntimeError("nvcc failed")) if fails
                        else future.set_result({})).start()
        return future

    monkeypatch.setattr(module.kernels, "build_in_background", build_in_background)
    monkeypatch.setattr(module.driver, "unload_module", lambda module: None)
    if at_open:
        device = module.Device(0, prepare=["rms_norm", "sample"])
    else:
        device = module.Device(0)
    device.prepare_kernels(iter(["rms_norm", "sample"]))  # under way already where given at the open
    assert builds == [("sm_90", ["rms_norm", "sample"], [] if at_open else ["primary"])]  # the context: after
    assert device.kernel_wait == 0
    if fails:
        with pytest.raises(RuntimeError, match="nvcc failed"):
            device.kernels
    else:
        assert device.kernels.loaded == [["rms_norm", "sample"]] and device.kernel_wait >= 0.15
        assert device.kernels.loaded == [["rms_norm", "sample"]]  # waited for once
    device.close()


class FakeCublasLt:
    """Every cuBLASLt call succeeds; the heuristics find one algorithm; matmuls are recorded (handle, A, B, C)."""

    def __init__(self):
        self.matmuls = []

    def __getattr__(self, name):
        def call(*args):
            if name == "cublasLtMatmulAlgoGetHeuristic":
                args[-1]._obj.value = 1
            if name == "cublasLtMatmul":
                self.matmuls.append(tuple(getattr(args[i], "value", args[i]) for i in (3, 5, 8)))  # w, x, out
            return 0
        return call


def test_cublas_gemm_and_tune_take_device_tensors(monkeypatch):
    lib = FakeCublasLt()
    monkeypatch.setattr(cublas, "_lib", lambda: lib)
    blas = cublas.Cublas(0, 4096, 1 << 20, exact_rows=frozenset({4}))
    x, w = DeviceTensor(100, BF16, (8, 64)), DeviceTensor(200, BF16, (32, 64))
    out = DeviceTensor(300, F32, (8, 32))
    blas.gemm(out, x, w, 6)
    blas.gemm(DeviceTensor(400, BF16, (8, 32)), x, w, 6, accumulate=True)
    assert blas.tune(out, x, w, 4, lambda run: run() or 1.0) == 0
    assert lib.matmuls[:2] == [(200, 100, 300), (200, 100, 400)]
    assert {key[:3] for key in blas.algos} == {(32, 64, cublas.BF16_GEMM_F32_OUT), (32, 64, cublas.BF16_GEMM)}
    assert (32, 64, cublas.BF16_GEMM_F32_OUT, 4) in blas.algos
    with pytest.raises(ValueError, match="do not fit"):
        blas.gemm(out, x, w, 9)
    blas.close()


class ConfigAwareCublasLt(FakeCublasLt):
    """FakeCublasLt whose algorithms keep their config attributes (in the opaque words), each heuristic answer
    numbered in its ID word and asking for split-K (SPLITK_NUM 4), and which records the row count of each query."""

    def __init__(self):
        super().__init__()
        self.queries: list[int] = []
        self.layouts: list[int] = []

    def __getattr__(self, name):
        if name == "cublasLtMatmulAlgoConfigSetAttribute":
            def set_attribute(algo, attribute, value, size):
                algo._obj.data[attribute] = ctypes.cast(value, ctypes.POINTER(ctypes.c_uint32)).contents.value
                return 0
            return set_attribute
        if name == "cublasLtMatmulAlgoConfigGetAttribute":
            def get_attribute(algo, attribute, value, size, written):
                ctypes.cast(value, ctypes.POINTER(ctypes.c_uint32)).contents.value = algo._obj.data[attribute]
                return 0
            return get_attribute
        if name == "cublasLtMatrixLayoutCreate":
            def create(ref, dtype, rows, cols, ld):
                ref._obj.value = 1 + len(self.layouts)
                self.layouts.append(cols)  # B's columns: the row count
                return 0
            return create
        if name == "cublasLtMatmulAlgoGetHeuristic":
            def heuristic(handle, desc, a, b, c, d, pref, count, results, found):
                self.queries.append(self.layouts[b.value - 1])
                results[0].algo.data[0] = len(self.queries)
                results[0].algo.data[cublas.CUBLASLT_ALGO_CONFIG_SPLITK_NUM] = 4
                found._obj.value = 1
                return 0
            return heuristic
        return super().__getattr__(name)


def test_invariant_algorithms_are_pinned_split_free(monkeypatch):
    """Batch-invariant: whatever the heuristics answer, the algorithm runs with K unsplit, the one they give at
    INVARIANT_ROWS for every m."""
    lib = ConfigAwareCublasLt()
    monkeypatch.setattr(cublas, "_lib", lambda: lib)
    monkeypatch.setattr(cublas, "INVARIANT_ROWS", 256)
    blas = cublas.Cublas(0, 4096, 1 << 20, invariant=True)
    algos = [blas.algorithm(m, 32, 64, cublas.BF16_GEMM_F32_OUT) for m in (1, 3, 100, 512)]
    assert {cublas.split_count(algo) for algo in algos} == {1}
    assert {algo.data[cublas.CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME] for algo in algos} == {0}
    assert lib.queries == [256] and len({algo.data[0] for algo in algos}) == 1
    blas.close()


class ScaleAwareCublasLt(FakeCublasLt):
    """FakeCublasLt that numbers its matmul descriptors, keeps each one's attributes, and whose heuristics answer
    `scaled_status` for a descriptor with outer-vector scales (CUBLAS_STATUS_NOT_SUPPORTED: an older cuBLASLt)."""

    def __init__(self, scaled_status=0):
        super().__init__()
        self.scaled_status, self.descs = scaled_status, {}

    def __getattr__(self, name):
        if name == "cublasLtMatmulDescCreate":
            def create(ref, compute, scale):
                ref._obj.value = len(self.descs) + 1
                self.descs[ref._obj.value] = {}
                return 0
            return create
        if name == "cublasLtMatmulDescSetAttribute":
            def set_attribute(desc, attribute, value, size):
                kind = ctypes.c_uint64 if size == 8 else ctypes.c_int32
                self.descs[desc.value][attribute] = ctypes.cast(value, ctypes.POINTER(kind)).contents.value
                return 0
            return set_attribute
        if name == "cublasLtMatmulAlgoGetHeuristic":
            def heuristic(handle, desc, *args):
                scaled = cublas.CUBLASLT_MATMUL_DESC_A_SCALE_MODE in self.descs[desc.value]
                if scaled and self.scaled_status:
                    return self.scaled_status
                args[-1]._obj.value = 1
                return 0
            return heuristic
        if name == "cublasLtMatmul":
            def matmul(handle, desc, *args):
                attrs = self.descs[desc.value]
                scales = tuple(attrs.get(a) for a in (cublas.CUBLASLT_MATMUL_DESC_A_SCALE_POINTER,
                                                      cublas.CUBLASLT_MATMUL_DESC_B_SCALE_POINTER))
                self.matmuls.append((args[1], args[3], args[6], scales))  # w, x, out, scales
                return 0
            return matmul
        return super().__getattr__(name)


@pytest.mark.parametrize("status", [0, cublas.CUBLAS_STATUS_NOT_SUPPORTED, 7])
def test_gemm_scaled_gives_cublaslt_the_outer_vector_scales(monkeypatch, status):
    """gemm_scaled runs one matmul on a descriptor of its own, outer-vector scale modes for A and B, A's scale
    pointer the weight's per-row scales and B's the input's per-token ones (set at each call), into bf16 or
    float32; where the heuristics refuse that descriptor it says so, nothing ran, and asks once."""
    lib = ScaleAwareCublasLt(status)
    monkeypatch.setattr(cublas, "_lib", lambda: lib)
    blas = cublas.Cublas(0, 4096, 1 << 20)
    w = DeviceTensor(200, E4M3, (32, 64), DeviceTensor(210, F32, (32,)))
    for out_dtype, x_scale in ((BF16, 110), (F32, 120)):
        x = DeviceTensor(100, E4M3, (8, 64), DeviceTensor(x_scale, F32, (8,)))
        assert blas.gemm_scaled(DeviceTensor(300, out_dtype, (8, 32)), x, w, 6, accumulate=True) == (status == 0)
    if status:
        assert lib.matmuls == [] and blas.heuristic_queries == 2  # once per output type, not per call
        assert not blas.gemm_scaled(DeviceTensor(300, BF16, (8, 32)), x, w, 6) and blas.heuristic_queries == 2
    else:
        other = cublas.Cublas(0, 4096, 1 << 20, algos=blas.algos)  # another stream's handle: the algorithms shared
        assert other.gemm_scaled(DeviceTensor(300, BF16, (8, 32)), x, w, 6) and blas.heuristic_queries == 2
        assert lib.matmuls[-1] == (200, 100, 300, (210, 120)) and other.heuristic_queries == 0
        other.close()
        assert lib.matmuls[:2] == [(200, 100, 300, (210, 110)), (200, 100, 300, (210, 120))]
        modes = lib.descs[blas.scaled_descs["channel"].value]
        assert modes[cublas.CUBLASLT_MATMUL_DESC_A_SCALE_MODE] == modes[cublas.CUBLASLT_MATMUL_DESC_B_SCALE_MODE] \
            == cublas.CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F
        assert cublas.CUBLASLT_MATMUL_DESC_A_SCALE_MODE not in lib.descs[blas.desc.value]
    with pytest.raises(ValueError, match="e4m3 inputs and weights with their scales"):
        blas.gemm_scaled(DeviceTensor(300, BF16, (8, 32)), DeviceTensor(100, E4M3, (8, 64)), w, 6)
    assert not cublas.Cublas(0, 4096, 1 << 20, invariant=True).gemm_scaled(DeviceTensor(300, BF16, (8, 32)), x, w, 6)
    blas.close()


@pytest.mark.parametrize("status", [0, cublas.CUBLAS_STATUS_NOT_SUPPORTED])
def test_gemm_scaled_gives_cublaslt_the_block_scales(monkeypatch, status):
    """A weight with 128 x 128 block scales: gemm_scaled runs on a descriptor of its own, block scale modes for A
    (the weights) and 128-column ones for B (the inputs), their scale pointers set at each call; scales_blocks asks
    the heuristics once per shape with placeholder pointers that are not null (a handle without a workspace too:
    with null ones cuBLASLt offers nothing), and never in batch-invariant mode."""
    lib = ScaleAwareCublasLt(status)
    monkeypatch.setattr(cublas, "_lib", lambda: lib)
    probe = cublas.Cublas(0, 0, 0)  # no workspace: a handle only asked
    assert probe.scales_blocks(256, 640) == (status == 0) and probe.scales_blocks(256, 640) == (status == 0)
    assert probe.heuristic_queries == 1
    modes = lib.descs[probe.scaled_descs["block"].value]
    assert (modes[cublas.CUBLASLT_MATMUL_DESC_A_SCALE_MODE], modes[cublas.CUBLASLT_MATMUL_DESC_B_SCALE_MODE]) == (
        cublas.CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F, cublas.CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F)
    assert modes[cublas.CUBLASLT_MATMUL_DESC_A_SCALE_POINTER] == modes[cublas.CUBLASLT_MATMUL_DESC_B_SCALE_POINTER] != 0
    assert not cublas.Cublas(0, 4096, 1 << 20, invariant=True).scales_blocks(256, 640)
    blas = cublas.Cublas(0, 4096, 1 << 20)
    w = DeviceTensor(200, E4M3, (256, 640), DeviceTensor(210, F32, (2, cublas.block_scale_stride(640))))
    x = DeviceTensor(100, E4M3, (8, 640), DeviceTensor(110, F32, (5 * 8,)))
    assert blas.gemm_scaled(DeviceTensor(300, F32, (8, 256)), x, w, 8, accumulate=True) == (status == 0)
    if status == 0:
        assert lib.matmuls == [(200, 100, 300, (210, 110))]
    with pytest.raises(ValueError, match="a scale per row or per 128 x 128 block"):
        blas.gemm_scaled(DeviceTensor(300, F32, (8, 256)), x, dataclasses.replace(
            w, scale=DeviceTensor(210, F32, (2, 5))), 8)  # the scales' rows not padded to 8 blocks of columns
    blas.close()
    probe.close()


def test_gemv_chain_declares_its_ring_as_dynamic_shared_memory():
    """gemv_chain's four kernels ask for CHAIN_WARPS rings of CHAIN_STAGES stages of 16 weight rows and 8 rows of x,
    each of CHAIN_K + 8 bf16 (cuda/gemv_chain.cu: a ring a warp), within an H100/H200 block's most; no other kernel
    outside moe.cu asks for any."""
    from tinyvllm.backends.cuda.ops import CHAIN8_STAGES, CHAIN_K, CHAIN_STAGES, CHAIN_WARPS

    shared = {name: sig.shared_bytes for name, sig in SIGNATURES.items() if sig.shared_bytes and sig.file != "moe"}
    # 8: gemv_chain8_*'s tiles, in a ring of CHAIN8_STAGES
    ring, ring8 = (stages * (tile + 8) * (CHAIN_K + 8) * 2 for tile, stages in ((16, CHAIN_STAGES), (8, CHAIN8_STAGES)))
    assert shared == {**dict.fromkeys(["gemv_chain_bf16", "gemv_chain_f32", "gemv_swiglu_chain", "gemv_geglu_chain"],
                                      CHAIN_WARPS * ring),
                      **dict.fromkeys(["gemv_chain8_bf16", "gemv_chain8_f32"], CHAIN_WARPS * ring8)}
    assert CHAIN_WARPS * max(ring, ring8) <= 227 * 1024


# a warp a 16-row tile: blocks of CHAIN_WARPS warps where the tiles fill every SM that many times, else fewer warps
# a block (one where there are fewer tiles than SMs), so that few tiles spread over the SMs
@pytest.mark.parametrize("n,num_sms,warps", [(128256, 132, 4), (16384, 132, 4), (3072, 132, 1), (2048, 132, 1),
                                             (8192, 132, 3), (2048, 0, 4), (40, 132, 1)])
def test_gemv_chain_spreads_its_tiles_over_the_sms(recorder, n, num_sms, warps):
    from tinyvllm.backends.cuda.ops import CHAIN_STAGES, CHAIN_K

    Ops(recorder, None, num_sms=num_sms).gemv_chain(1, 2, 3, 1, n, 2048, False, False)
    tiles = -(-n // 16)
    assert recorder.launches == [("gemv_chain_bf16", (-(-tiles // warps),), (32 * warps, 1, 1))]
    assert recorder.shared == [warps * CHAIN_STAGES * (16 + 8) * (CHAIN_K + 8) * 2]  # weight rows, x rows


# tiles of 8 rows (x the mma's A operand): twice the tiles, spread the same way
@pytest.mark.parametrize("n,num_sms,warps", [(2048, 132, 1), (16384, 132, 4), (128256, 132, 4), (40, 132, 1)])
@pytest.mark.parametrize("out_fp32", [False, True])
def test_gemv_chain_in_8_row_tiles(recorder, n, num_sms, warps, out_fp32):
    from tinyvllm.backends.cuda.ops import CHAIN8_STAGES, CHAIN_K

    Ops(recorder, None, num_sms=num_sms).gemv_chain(1, 2, 3, 1, n, 2048, out_fp32, True, tile_rows=8)
    tiles = -(-n // 8)
    name = "gemv_chain8_f32" if out_fp32 else "gemv_chain8_bf16"
    assert recorder.launches == [(name, (-(-tiles // warps),), (32 * warps, 1, 1))]
    assert recorder.shared == [warps * CHAIN8_STAGES * (8 + 8) * (CHAIN_K + 8) * 2]
    assert recorder.args[-1][-1] == 1  # accumulate
    with pytest.raises(ValueError, match="tiles of 4 rows"):
        Ops(recorder, None, num_sms=num_sms).gemv_chain(1, 2, 3, 1, n, 2048, out_fp32, False, tile_rows=4)
