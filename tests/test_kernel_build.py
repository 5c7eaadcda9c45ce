"""Which compile jobs build which kernels, what start-up builds for a model, the kernel table's loading, and
`tinyvllm build-kernels` filling the cache (with a stand-in nvcc, and the real one when present). No GPU."""

from __future__ import annotations

import os
import re
import shutil
import stat
import threading
import time

import pytest
from click.testing import CliRunner

from tinyvllm.backends.cuda import kernel_cache, kernels
from tinyvllm.backends.cuda.kernel_cache import (OPTIONS, SPLIT_FILES, CompileJob, KernelCompileError, cache_key,
                                                 compile_jobs, job_kernels, job_name)
from tinyvllm.backends.cuda.ops import DEFINES, HEAD_DIMS, SIGNATURES
from tinyvllm.cli import main

ATTENTION_INSTANCE = re.compile(r"attention_(decode|prefill)_")
NVCC = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if os.path.exists("/usr/local/cuda/bin/nvcc") else None)


def test_every_kernel_is_built_by_exactly_one_job():
    jobs = compile_jobs()
    built = [kernel for job in jobs for kernel in job_kernels(job.name)]
    assert sorted(built) == sorted(SIGNATURES)
    for job in jobs:
        split = job.file in SPLIT_FILES
        assert job.name == (job_kernels(job.name)[0] if split else job.file)
        assert job.source == (kernel_cache.cuda_dir() / f"{job.file}.cu").read_text()
        select = {"SELECT_KERNELS": 1, f"KEEP_{job.name}": 1} if split else {}
        assert dict(job.defines) == {**DEFINES.get(job.file, {}), **select}
    assert len([job for job in jobs if job.file == "gemv"]) == 8  # a job per gemv kernel


def test_each_kernel_of_a_split_file_is_behind_its_own_guard():
    """A split job builds its kernel only if the file guards each kernel with KEEPS(name) (common.cuh)."""
    for file in SPLIT_FILES:
        source = (kernel_cache.cuda_dir() / f"{file}.cu").read_text()
        guarded = re.findall(r"#if KEEPS\((\w+)\)", source)
        assert sorted(guarded) == sorted(name for name, s in SIGNATURES.items() if s.file == file), file


def test_cache_keys_are_deterministic_and_a_whole_file_is_keyed_by_its_inputs_only():
    headers = {"common.cuh": "// h"}
    first = [cache_key(job, headers, "nvcc 13.0", "sm_90") for job in compile_jobs()]
    assert first == [cache_key(job, dict(headers), "nvcc 13.0", "sm_90") for job in compile_jobs()]
    assert len(set(first)) == len(first)  # the split jobs of one source differ by their KEEP_ define
    norm = next(job for job in compile_jobs() if job.name == "norm")
    same = CompileJob("norm", norm.source, DEFINES["norm"], OPTIONS)  # no `file`: it is not part of the key
    assert cache_key(norm, headers, "nvcc 13.0", "sm_90") == cache_key(same, headers, "nvcc 13.0", "sm_90")


@pytest.mark.parametrize("head_dim,heads,kv_heads,fp8,attention", [
    (64, 32, 8, False, {"attention_decode_d64_r8", "attention_prefill_d64"}),  # Llama-3.2-1B
    (128, 32, 8, False, {"attention_decode_d128_r8", "attention_prefill_d128"}),  # Llama-3.1-8B
    (128, 28, 4, True, {"attention_decode_fp8_d128_r8", "attention_prefill_fp8_d128"}),
    (64, 9, 3, False, {"attention_decode_d64_r8", "attention_prefill_d64"}),  # SmolLM2-135M
    (128, 16, 1, False, {"attention_decode_d128_r16", "attention_prefill_d128"}),
    (96, 32, 32, False, {"attention_decode_d96_r8", "attention_prefill_d96"}),  # Phi-3.5-mini
    (256, 4, 1, True, {"attention_decode_fp8_d256_r8", "attention_prefill_fp8_d256"}),  # Gemma-3-1B
    (80, 32, 8, False, set())])  # refused by the forward: no attention kernel to build
def test_needed_kernels_keep_one_instance_of_each_attention_kernel(head_dim, heads, kv_heads, fp8, attention):
    needed = kernels.needed_kernels(head_dim, heads, kv_heads, fp8)
    assert {name for name in needed if ATTENTION_INSTANCE.match(name)} == attention
    fp8_weights = {name for name, signature in SIGNATURES.items() if signature.file == "fp8"}
    geglu = {name for name in SIGNATURES if name.startswith("gemv_geglu_")}  # a GeGLU model's (Gemma's) only
    experts = {name for name, signature in SIGNATURES.items() if signature.file == "moe"}
    others = ({name for name in SIGNATURES if not ATTENTION_INSTANCE.match(name)}
              - {"attention_combine", "attention_combine_inv"}
              - kernels.COMBINE_QUANTIZE_KERNELS - fp8_weights - geglu - experts)
    assert others <= set(needed)  # gemv's every form (ops.py picks among them by shape and SM count), ...
    assert not geglu & set(needed)
    gemma = kernels.needed_kernels(head_dim, heads, kv_heads, fp8, activation="gelu_pytorch_tanh")
    assert set(gemma) ^ set(needed) == (geglu | {name for name in SIGNATURES if name.startswith("gemv_swiglu_")}) - \
        fp8_weights  # the FP8 forms of both: only with FP8 weights
    fp8_needed = set(kernels.needed_kernels(head_dim, heads, kv_heads, fp8, fp8_weights=True))
    assert not fp8_weights & set(needed) and fp8_weights - geglu <= fp8_needed
    # the merge that quantizes O's input: with FP8 weights and an attention kernel to merge
    assert not kernels.COMBINE_QUANTIZE_KERNELS & set(needed)
    assert (kernels.COMBINE_QUANTIZE_KERNELS <= fp8_needed) == bool(attention)
    assert not experts & set(needed) and experts <= set(kernels.needed_kernels(head_dim, heads, kv_heads, fp8,
                                                                                experts=True))
    assert ("attention_combine" in needed) == (head_dim in HEAD_DIMS)
    # batch-invariant: the _inv forms and their merge in place of the others, no merge that quantizes
    invariant = set(kernels.needed_kernels(head_dim, heads, kv_heads, fp8, fp8_weights=True, invariant=True))
    assert {name for name in invariant if ATTENTION_INSTANCE.match(name)} == {name + "_inv" for name in attention}
    assert ("attention_combine_inv" in invariant) == bool(attention) and "attention_combine" not in invariant
    assert not kernels.COMBINE_QUANTIZE_KERNELS & invariant
    jobs = compile_jobs(needed)  # and nothing else of the split files is compiled
    assert {kernel for job in jobs if job.file in SPLIT_FILES for kernel in job_kernels(job.name)} == \
        {name for name in needed if SIGNATURES[name].file in SPLIT_FILES}


@pytest.fixture
def fake_builds(monkeypatch):
    """kernels.build_cubins replaced: records each call's job names, returns b"cubin:<job>" per job."""
    calls: list[list[str]] = []

    def build(jobs, arch, cache_dir=None):
        calls.append([job.name for job in jobs])
        time.sleep(0.05)
        return {job.name: f"cubin:{job.name}:{arch}".encode() for job in jobs}

    monkeypatch.setattr(kernels, "build_cubins", build)
    monkeypatch.setattr(kernels, "_built", {})
    return calls


def test_cubins_are_built_once_per_process_and_arch(fake_builds):
    assert kernels.cubins("sm_90", ["gemv_bf16", "rms_norm"]) == {"gemv_bf16": b"cubin:gemv_bf16:sm_90",
                                                                   "norm": b"cubin:norm:sm_90"}
    assert kernels.cubins("sm_90", ["rms_norm", "embedding", "resolve_tokens"]) == {
        "norm": b"cubin:norm:sm_90", "embedding": b"cubin:embedding:sm_90"}
    kernels.cubins("sm_80", ["rms_norm"])
    assert fake_builds == [["gemv_bf16", "norm"], ["embedding"], ["norm"]]


def test_build_in_background_returns_at_once_and_raises_a_missing_nvcc_at_once(fake_builds, monkeypatch):
    start = time.perf_counter()
    future = kernels.build_in_background("sm_90", ["rms_norm", "gemv_f32"])
    assert time.perf_counter() - start < 0.04 and not future.done()  # the build takes 0.05 s
    assert future.result(timeout=10) == {"norm": b"cubin:norm:sm_90", "gemv_f32": b"cubin:gemv_f32:sm_90"}

    def no_nvcc():
        raise KernelCompileError("cannot find nvcc")

    monkeypatch.setattr(kernels, "find_nvcc", no_nvcc)
    with pytest.raises(KernelCompileError, match="cannot find nvcc"):
        kernels.build_in_background("sm_90", ["rms_norm"])


def test_a_failed_background_build_raises_for_whoever_waits(monkeypatch):
    def failing(jobs, arch, cache_dir=None):
        raise KernelCompileError("compiling cuda/norm.cu failed:\nerror")

    monkeypatch.setattr(kernels, "build_cubins", failing)
    monkeypatch.setattr(kernels, "_built", {})
    monkeypatch.setattr(kernels, "find_nvcc", lambda: "nvcc")
    with pytest.raises(KernelCompileError, match="cuda/norm.cu"):
        kernels.build_in_background("sm_90", ["rms_norm"]).result(timeout=10)


def test_kernel_table_loads_a_jobs_module_once_and_the_rest_at_first_lookup(fake_builds, monkeypatch):
    loaded = []
    monkeypatch.setattr(kernels.driver, "load_module", lambda cubin: loaded.append(cubin) or len(loaded))
    monkeypatch.setattr(kernels.driver, "get_function", lambda module, name: 1000 * module)
    monkeypatch.setattr(kernels.driver, "Launcher",
                        lambda function, arg_format, programmatic, shared: (function, programmatic, shared))
    table = kernels.KernelTable("sm_90", programmatic=True)
    table.load(["rms_norm", "attention_decode_d64_r8"])
    assert sorted(table) == ["attention_decode_d64_r8", "rms_norm", "rms_norm_e4m3", "rms_norm_residual",
                             "rms_norm_residual_e4m3"] and len(loaded) == 2
    assert table["rms_norm"].launcher == (1000, True, 0)
    table.load(["rms_norm"])  # loaded already
    assert len(loaded) == 2
    threads = [threading.Thread(target=lambda: table["resolve_tokens"]) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert loaded.count(b"cubin:embedding:sm_90") == 1  # one module for its two kernels, however many ask
    assert {"embedding", "resolve_tokens"} <= set(table)
    assert set(table.modules) == {"norm", "attention_decode_d64_r8", "embedding"}
    with pytest.raises(KeyError):
        table["no_such_kernel"]


FAKE_NVCC = """#!/bin/sh
# a stand-in nvcc: answers --version, writes an ELF-looking cubin, logs each compile
if [ "$1" = "--version" ]; then echo "stand-in nvcc 1.0"; exit 0; fi
echo "$@" >> "$NVCC_LOG"
out=""; prev=""
for a in "$@"; do [ "$prev" = "-o" ] && out="$a"; prev="$a"; done
printf '\\177ELF stand-in' > "$out"
"""


def stand_in(tmp_path, monkeypatch, name: str, script: str):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    path = bin_dir / name
    path.write_text(script)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")


def test_build_kernels_fills_the_cache_with_every_job_once(tmp_path, monkeypatch):
    stand_in(tmp_path, monkeypatch, "nvcc", FAKE_NVCC)
    monkeypatch.setenv("NVCC_LOG", str(tmp_path / "nvcc.log"))
    monkeypatch.setenv("TINYVLLM_KERNEL_CACHE", str(tmp_path / "cache"))
    result = CliRunner().invoke(main, ["build-kernels", "--arch", "sm_90"])
    assert result.exit_code == 0, result.output
    jobs = compile_jobs()
    assert f"{len(jobs)} kernel cubins for sm_90 in {tmp_path / 'cache'}" in result.output
    assert len(list((tmp_path / "cache").glob("*.cubin"))) == len(jobs)
    log = (tmp_path / "nvcc.log").read_text().splitlines()
    assert len(log) == len(jobs) and all("-arch=sm_90" in line for line in log)
    assert sum("-DKEEP_gemv_f32_pipelined=1" in line for line in log) == 1
    # what a start-up asks for is there now: nothing compiled again
    cubins = kernel_cache.build_cubins(compile_jobs(kernels.needed_kernels(64, 32, 8, False)), "sm_90")
    assert all(cubin.startswith(b"\x7fELF") for cubin in cubins.values())
    assert CliRunner().invoke(main, ["build-kernels", "--arch", "sm_90"]).exit_code == 0
    assert len((tmp_path / "nvcc.log").read_text().splitlines()) == len(jobs)


def test_build_kernels_takes_the_gpus_architectures_from_nvidia_smi(tmp_path, monkeypatch):
    stand_in(tmp_path, monkeypatch, "nvcc", FAKE_NVCC)
    stand_in(tmp_path, monkeypatch, "nvidia-smi", '#!/bin/sh\necho 9.0\necho 9.0\necho 8.0\n')
    monkeypatch.setenv("NVCC_LOG", str(tmp_path / "nvcc.log"))
    monkeypatch.setenv("TINYVLLM_KERNEL_CACHE", str(tmp_path / "cache"))
    kernels.gpu_archs.cache_clear()
    result = CliRunner().invoke(main, ["build-kernels"])
    kernels.gpu_archs.cache_clear()
    assert result.exit_code == 0, result.output
    assert re.findall(r"cubins for (sm_\d+)", result.output) == ["sm_90", "sm_80"]


def test_build_kernels_errors_are_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # neither nvidia-smi nor nvcc
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))
    kernels.gpu_archs.cache_clear()
    no_gpu = CliRunner().invoke(main, ["build-kernels"])
    kernels.gpu_archs.cache_clear()
    assert no_gpu.exit_code == 1 and "give the architecture, e.g. --arch sm_90" in no_gpu.output
    assert len(no_gpu.output.strip().splitlines()) == 1
    bad = CliRunner().invoke(main, ["build-kernels", "--arch", "90"])
    assert bad.exit_code == 2 and "'90' is not an architecture such as sm_90" in bad.output
    good_then_bad = CliRunner().invoke(main, ["build-kernels", "--arch", "sm_90", "--arch", "90"])
    assert good_then_bad.exit_code == 2 and "'90' is not an architecture" in good_then_bad.output  # before any nvcc
    no_nvcc = CliRunner().invoke(main, ["build-kernels", "--arch", "sm_90"])
    assert no_nvcc.exit_code == 1 and "cannot find nvcc" in no_nvcc.output
    assert len(no_nvcc.output.strip().splitlines()) == 1


@pytest.mark.skipif(NVCC is None, reason="needs nvcc (the CUDA toolkit)")
def test_nvcc_builds_only_the_selected_kernel_of_a_split_file(tmp_path):
    jobs = compile_jobs(["attention_decode_d64_r8", "gemv_f32_pipelined"])
    cubins = kernel_cache.build_cubins(jobs, "sm_90", tmp_path)
    for job in jobs:
        names = set(re.findall(rb"(?:attention|gemv)_\w+", cubins[job.name]))
        kernels_in = {name.decode() for name in names if name.decode() in SIGNATURES}
        assert kernels_in == {job.name}, kernels_in


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
@pytest.mark.parametrize("gpu", [True, False])
def test_make_setup_builds_the_kernels_ahead_on_a_gpu_host_once(tmp_path, monkeypatch, gpu):
    """`make setup` runs `tinyvllm build-kernels` where nvidia-smi and pycuda are (stand-ins here), once until a
    kernel source changes; not with NO_CUDA=1 (the CPU setup)."""
    import subprocess
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    stand_in(tmp_path, monkeypatch, "nvidia-smi", "#!/bin/sh\necho 9.0\n")
    for name, script in (("python", "#!/bin/sh\nexit 0\n"),  # `python -c "import pycuda"` succeeds
                         ("tinyvllm", f'#!/bin/sh\necho "$@" >> {tmp_path}/built\n')):
        (venv / "bin" / name).write_text(script)
        (venv / "bin" / name).chmod(0o755)
    (venv / ".installed").touch()

    def make() -> None:
        subprocess.run(["make", "-s", "-C", str(repo), "setup", f"VENV={venv}", *([] if gpu else ["NO_CUDA=1"])],
                       check=True, capture_output=True)

    make()
    make()
    built = tmp_path / "built"
    assert (built.read_text().splitlines() if built.exists() else []) == (["build-kernels"] if gpu else [])
    assert (venv / ".kernels").exists()
