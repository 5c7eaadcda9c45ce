"""The cubin cache and parallel compile driver of the CUDA backend, with a fake compiler (and nvcc when present)."""

from __future__ import annotations

import os
import shutil
import stat
import threading
import time

import pytest

from tinyvllm.backends.cuda.kernel_cache import (CompileJob, KernelCache, KernelCompileError, build_all,
                                                 build_cubins, cache_key, compile_jobs, default_cache_dir)

HEADERS = {"common.cuh": "// common"}


def job(name: str, source: str = "src", defines=None) -> CompileJob:
    return CompileJob(name, source, defines or {}, ("-O3",))


class FakeCompiler:
    """Returns a cubin naming the job and its source; counts calls and how many ran at once."""

    def __init__(self, delay: float = 0.0) -> None:
        self.calls: list[str] = []
        self.delay = delay
        self.running = self.most_running = 0
        self.lock = threading.Lock()

    def __call__(self, j: CompileJob) -> bytes:
        with self.lock:
            self.calls.append(j.name)
            self.running += 1
            self.most_running = max(self.most_running, self.running)
        time.sleep(self.delay)
        with self.lock:
            self.running -= 1
        return f"cubin:{j.name}:{j.source}".encode()


def build(jobs, compiler, cache, headers=HEADERS, version="nvcc 13.0", arch="sm_90"):
    return build_all(jobs, compiler, cache, headers, version, arch)


def test_key_changes_with_every_input():
    base = cache_key(job("norm"), HEADERS, "v1", "sm_90")
    assert base == cache_key(job("norm"), dict(HEADERS), "v1", "sm_90")
    variants = [cache_key(job("norm", source="other"), HEADERS, "v1", "sm_90"),
                cache_key(job("norm"), {"common.cuh": "// changed"}, "v1", "sm_90"),
                cache_key(job("norm"), {**HEADERS, "mma.cuh": ""}, "v1", "sm_90"),
                cache_key(job("norm", defines={"BLOCK_M": 64}), HEADERS, "v1", "sm_90"),
                cache_key(job("norm", defines={"BLOCK_M": 32}), HEADERS, "v1", "sm_90"),
                cache_key(CompileJob("norm", "src", {}, ("-O2",)), HEADERS, "v1", "sm_90"),
                cache_key(job("norm"), HEADERS, "v2", "sm_90"),
                cache_key(job("norm"), HEADERS, "v1", "sm_80"),
                cache_key(job("cache"), HEADERS, "v1", "sm_90")]
    assert len({base, *variants}) == 1 + len(variants)


def test_cold_compiles_in_parallel_then_warm_compiles_nothing(tmp_path):
    jobs = [job(f"k{i}") for i in range(4)]
    cold = FakeCompiler(delay=0.2)
    cubins = build_all(jobs, cold, KernelCache(tmp_path), HEADERS, "nvcc 13.0", "sm_90",
                       max_workers=4)
    assert cubins == {f"k{i}": f"cubin:k{i}:src".encode() for i in range(4)}
    assert sorted(cold.calls) == [f"k{i}" for i in range(4)]
    assert cold.most_running > 1  # compiled side by side, not one after another
    warm = FakeCompiler()
    assert build(jobs, warm, KernelCache(tmp_path)) == cubins
    assert warm.calls == []


def test_a_changed_source_recompiles_only_that_file(tmp_path):
    build([job("a"), job("b")], FakeCompiler(), KernelCache(tmp_path))
    again = FakeCompiler()
    cubins = build([job("a", source="new"), job("b")], again, KernelCache(tmp_path))
    assert again.calls == ["a"]
    assert cubins["a"] == b"cubin:a:new"


@pytest.mark.parametrize("damage", ["truncate", "flip", "empty"])
def test_damaged_entry_is_recompiled_and_replaced(tmp_path, damage):
    cache = KernelCache(tmp_path)
    build([job("a")], FakeCompiler(), cache)
    path = cache.path(cache_key(job("a"), HEADERS, "nvcc 13.0", "sm_90"))
    data = path.read_bytes()
    path.write_bytes({"truncate": data[:5], "flip": bytes([data[0] ^ 1]) + data[1:], "empty": b""}[damage])
    again = FakeCompiler()
    assert build([job("a")], again, cache) == {"a": b"cubin:a:src"}
    assert again.calls == ["a"]
    assert path.read_bytes() == data  # rewritten whole


def test_symlinked_entry_is_not_followed(tmp_path):
    cache = KernelCache(tmp_path / "cache")
    target = tmp_path / "elsewhere"
    target.write_bytes(b"not mine")
    key = cache_key(job("a"), HEADERS, "nvcc 13.0", "sm_90")
    cache.path(key).symlink_to(target)
    assert cache.get(key) is None
    build([job("a")], FakeCompiler(), cache)
    assert target.read_bytes() == b"not mine"  # the rename replaced the link, not what it points at
    assert not cache.path(key).is_symlink()
    assert cache.get(key) == b"cubin:a:src"


def test_entries_are_written_whole_under_their_key_only(tmp_path):
    cache = KernelCache(tmp_path)
    build([job("a"), job("b")], FakeCompiler(), cache)
    assert sorted(p.suffix for p in tmp_path.iterdir()) == [".cubin", ".cubin"]
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o644 for p in tmp_path.iterdir())  # shareable
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


def test_cache_dir_is_owner_only_and_follows_tinyvllm_cache(tmp_path, monkeypatch):
    monkeypatch.delenv("TINYVLLM_KERNEL_CACHE", raising=False)
    monkeypatch.setenv("TINYVLLM_CACHE", str(tmp_path / "root"))
    assert default_cache_dir() == tmp_path / "root" / "kernels"
    KernelCache(default_cache_dir())
    assert stat.S_IMODE(os.stat(default_cache_dir()).st_mode) & 0o077 == 0
    monkeypatch.setenv("TINYVLLM_KERNEL_CACHE", str(tmp_path / "shared"))
    assert default_cache_dir() == tmp_path / "shared"


def test_unwritable_cache_still_builds(tmp_path):
    cache = KernelCache(tmp_path / "cache")
    shutil.rmtree(cache.dir)  # gone after start-up: writing fails (as it would for a read-only directory)
    cache.dir.write_text("a file now")
    assert build([job("a")], FakeCompiler(), cache) == {"a": b"cubin:a:src"}


def test_compile_error_propagates_and_caches_nothing(tmp_path):
    def failing(j: CompileJob) -> bytes:
        raise KernelCompileError(f"compiling cuda/{j.name}.cu failed:\nerror")

    with pytest.raises(KernelCompileError, match="cuda/a.cu"):
        build([job("a")], failing, KernelCache(tmp_path))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(shutil.which("nvcc") is None and not os.path.exists("/usr/local/cuda/bin/nvcc"),
                    reason="needs nvcc (the CUDA toolkit)")
def test_nvcc_compiles_kernel_files_into_the_cache(tmp_path):
    jobs = [j for j in compile_jobs() if j.name in ("embedding", "cache")]
    cubins = build_cubins(jobs, "sm_90", tmp_path)
    assert set(cubins) == {"embedding", "cache"}
    assert all(c[:4] == b"\x7fELF" for c in cubins.values())  # a cubin is an ELF image
    assert len(list(tmp_path.glob("*.cubin"))) == 2
    assert build_cubins(jobs, "sm_90", tmp_path) == cubins  # from the cache this time
    broken = CompileJob("broken", "this is not CUDA", {}, ())
    with pytest.raises(KernelCompileError, match="compiling cuda/broken.cu failed"):
        build_cubins([broken], "sm_90", tmp_path)


def test_the_kernel_sources_are_found_when_first_needed():
    """kernel_cache looks for cuda/ at the first compile (cuda_dir), not at import."""
    from tinyvllm.backends.cuda import kernel_cache

    assert not hasattr(kernel_cache, "CUDA_DIR")
    assert (kernel_cache.cuda_dir() / "common.cuh").is_file()
    assert {job.file for job in compile_jobs()} >= {"embedding", "gemv", "attention_decode"}
