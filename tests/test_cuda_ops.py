"""The CUDA launchers (backends/cuda/ops.py) without a GPU: their argument types against the kernels' C declarations,
their geometry, and the preconditions they refuse. The kernels themselves are tested in tests/gpu."""

import re
from pathlib import Path

import numpy as np
import pytest

from tinyvllm.backends.cuda import ops
from tinyvllm.backends.cuda.ops import DEFINES, SIGNATURES, Ops

CUDA_DIR = Path(__file__).resolve().parents[1] / "cuda"
KERNEL = re.compile(r'extern "C" __global__ void\s+(?:__launch_bounds__\([^)]*\)\s*)?([\w#]+)\s*\(([^)]*)\)')


def declared_kernels(file: str) -> dict[str, str]:
    """{kernel name pattern: normalized C parameters} of the extern "C" kernels of cuda/<file>.cu; a name made by a
    macro (attention_decode_d##D##_r##ROWS) becomes a regular expression."""
    source = (CUDA_DIR / f"{file}.cu").read_text().replace("\\\n", " ")
    kernels = {}
    for name, params in KERNEL.findall(source):
        parts = name.split("##")  # literal text, then a macro argument, alternately
        pattern = "".join(re.escape(p) if i % 2 == 0 else r"\w*" for i, p in enumerate(parts))
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
    assert SIGNATURES["rms_norm"].arg_format == "PPPPif"
    assert SIGNATURES["sample"].arg_format == "PPiPPPPP"
    assert SIGNATURES["attention_decode_d128_r16"].arg_format == "PPPPPPPPPfiiiii"


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
    with pdl_begin(); gemv alone loads weights (which no kernel writes) before its wait, and attention_decode lets
    the next kernel launch only after its loop (common.cuh says why)."""
    for path in sorted(CUDA_DIR.glob("*.cu")):
        source = path.read_text().replace("\\\n", " ")
        kernels = function_bodies(source, r'extern "C" __global__ void\s+(?:__launch_bounds__\([^)]*\)\s*)?([\w#]+)')
        templates = function_bodies(source, r"template <[^>]*>\s*__device__ void\s+(\w+)")
        assert kernels, path
        for name, body in kernels.items():
            first = body.strip()
            forwarded = re.match(r"(\w+)\s*[<(]", first)
            if forwarded and forwarded.group(1) in templates:
                first = templates[forwarded.group(1)].strip()
            if path.stem == "gemv":
                assert first.startswith("__shared__") and "grid_dependency_wait();" in first, name
                before_wait = first.split("grid_dependency_wait();")[0]
                assert "__ldg" not in before_wait and "x_row +" not in before_wait, "gemv reads x before its wait"
                assert "allow_dependents_launch();" in before_wait and not launched_after_loop(first), name
            elif forwarded and forwarded.group(1) == "attention_decode":
                assert first.startswith("grid_dependency_wait();") and launched_after_loop(first), name
            else:
                assert first.startswith("pdl_begin();"), (path.name, name, first[:80])


def test_tile_constants_come_from_python_only():
    sources = {p.stem: p.read_text() for p in CUDA_DIR.glob("*.c*")}
    for file, defines in DEFINES.items():
        for name in defines:
            assert re.search(rf"\b{name}\b", sources[file]), (file, name)  # the kernel uses it
            assert not any(re.search(rf"#define\s+{name}\b", s) for s in sources.values()), name  # and only -D sets it


class Recorder(dict):
    """Stands in for the compiled kernels: records each launch and its arguments, checking their count."""

    def __init__(self):
        super().__init__()
        self.launches = []
        self.args = []

    def __missing__(self, name):
        def launch(grid, block, stream, *args):
            assert len(args) == len(SIGNATURES[name].arg_format), name
            self.launches.append((name, grid, block))
            self.args.append(args)
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
])
def test_attention_decode_geometry(recorder, heads, kv_heads, d, splits, kernel, grid):
    context_lens = 9
    Ops(recorder, None).attention_decode(*range(1, context_lens + 1), 5, 0.125, heads, kv_heads, d, 16, 4096, splits)
    combine = [("attention_combine", (heads, 5), (d, 1, 1))] if splits > 1 else []
    assert recorder.launches == [(kernel, grid, (ops.DECODE_WARPS * 32, 1, 1)), *combine]
    if combine:  # the combine reads the contexts, to know how many parts each has
        assert recorder.args[-1] == (1, 2, 3, context_lens, splits)


def test_decode_splits():
    # 4 blocks (of 2 warps) per sequence here: small batches cut as far as ~2 blocks per SM need, at least 8 parts
    assert ops.decode_splits(1, 8, 4, num_sms=132) == ops.MAX_SPLITS
    assert ops.decode_splits(4, 8, 4, num_sms=132) == 17  # 16 blocks x 17 >= 264
    assert ops.decode_splits(40, 8, 4, num_sms=132) == ops.SMALL_BATCH_SPLITS  # 160 blocks: x2 would do
    assert ops.decode_splits(66, 8, 4, num_sms=132) == 1  # 264 blocks


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
    (lambda o: o.attention_decode(*range(1, 10), 5, 0.1, 32, 8, 96, 16, 4096, 1), "head_dim 96"),
    (lambda o: o.attention_decode(*range(1, 10), 5, 0.1, 32, 8, 64, 16, 4096, 0), "num_splits 0 < 1"),
    (lambda o: o.attention_prefill(*range(1, 11), 7, 0.1, 30, 8, 64, 16, 4096), "30 query heads"),
])
def test_launchers_refuse_shapes_their_kernels_cannot_run(recorder, launch, message):
    with pytest.raises(ValueError, match=message):
        launch(Ops(recorder, None))
    assert recorder.launches == []
