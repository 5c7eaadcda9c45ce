"""backends/cuda/driver.py's Launcher on any machine: the module loaded against a stand-in for libcuda."""

from __future__ import annotations

import ctypes
import importlib.util
import threading
import time
from pathlib import Path

import pytest

import tinyvllm.backends.cuda

DRIVER = Path(tinyvllm.backends.cuda.__file__).parent / "driver.py"  # imported by path: libcuda is faked


class FakeLibcuda:
    """Every driver function a no-op returning CUDA_SUCCESS, except cuLaunchKernelEx: it reads the launch's
    configuration after a pause that lets other threads run (as the real call does, ctypes having let go of the
    GIL), and records the grid and stream it launched with."""

    def __init__(self) -> None:
        self.launches: list[tuple[int, int, int]] = []  # (thread, grid x, stream)
        self.shared: list[int] = []  # each launch's dynamic shared memory
        self.lock = threading.Lock()

    def __getattr__(self, name: str):
        function = self.launch if name == "cuLaunchKernelEx" else (lambda *args: 0)
        wrapper = type("Function", (), {"__call__": staticmethod(function)})()
        setattr(self, name, wrapper)  # argtypes and restype are set on it
        return wrapper

    def launch(self, config_ref, function, params, extra) -> int:
        time.sleep(0.0005)
        config = config_ref._obj
        with self.lock:
            self.launches.append((threading.get_ident(), config.grid[0], config.stream or 0))
            self.shared.append(config.shared_mem_bytes)
        return 0


@pytest.fixture
def driver(monkeypatch):
    lib = FakeLibcuda()
    monkeypatch.setattr(ctypes, "CDLL", lambda name: lib)
    spec = importlib.util.spec_from_file_location("driver_under_test", DRIVER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, lib


def test_threads_launching_one_kernel_keep_their_own_grid_and_stream(driver):
    """Lazy graph capture launches a bucket's kernels on its thread while the engine's thread launches the same
    kernels: each launch must go out with its own thread's grid and stream."""
    module, lib = driver
    launcher = module.Launcher(1234, "Pi", programmatic=True)
    threads = 4
    expected: dict[int, int] = {}

    def run(index: int) -> None:
        expected[threading.get_ident()] = index + 1
        for _ in range(25):
            assert launcher((index + 1,), (32, 1, 1), 100 + index, (0, index)) == 0

    workers = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert len(lib.launches) == threads * 25
    for thread, grid, stream in lib.launches:
        assert (grid, stream) == (expected[thread], 99 + expected[thread])


def test_programmatic_launch_sets_its_attribute_in_every_thread(driver):
    module, _ = driver
    launcher = module.Launcher(1234, "", programmatic=True)
    configs = [launcher._config()]
    worker = threading.Thread(target=lambda: configs.append(launcher._config()))
    worker.start()
    worker.join()
    assert configs[0] is not configs[1]
    for config in configs:
        assert config.num_attrs == 1
        assert config.attrs.contents.id == module.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    assert module.Launcher(1234, "", programmatic=False)._config().num_attrs == 0


def test_dynamic_shared_memory_is_allowed_once_and_given_to_every_launch(driver):
    """A kernel with dynamic shared memory (the MoE grouped GEMM's pipeline stages, past 48 KB) has its maximum
    raised when it is loaded, and every thread's launches carry the size, or a smaller one a launch asks for (the
    FP8 GEMV's x codes), never more; others ask for none."""
    module, lib = driver
    calls = []
    lib.cuFuncSetAttribute = lambda function, attribute, value: calls.append((function.value, attribute, value)) or 0
    launcher = module.Launcher(1234, "", programmatic=True, shared_bytes=69120)
    assert calls == [(1234, module.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, 69120)]
    launcher((1,), (32, 1, 1), 0, ())
    worker = threading.Thread(target=lambda: launcher((1,), (32, 1, 1), 0, ()))
    worker.start()
    worker.join()
    launcher((1,), (32, 1, 1), 0, (), 4112)
    launcher((1,), (32, 1, 1), 0, ())
    assert lib.shared == [69120, 69120, 4112, 69120]
    with pytest.raises(ValueError, match="69121 bytes of dynamic shared memory for a kernel declared with 69120"):
        launcher((1,), (32, 1, 1), 0, (), 69121)
    module.Launcher(1234, "", programmatic=True)((1,), (32, 1, 1), 0, ())
    assert lib.shared[-1] == 0 and len(calls) == 1


def test_importing_the_driver_loads_no_library(monkeypatch):
    """libcuda is opened at the first driver call, not at import: the backend's modules import on a machine without
    one, and no device is touched before a Device asks."""
    opened = []

    def no_libcuda(name):
        opened.append(name)
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(ctypes, "CDLL", no_libcuda)
    spec = importlib.util.spec_from_file_location("driver_without_libcuda", DRIVER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert opened == []
    with pytest.raises(OSError, match="libcuda.so.1"):
        module.load_module(b"")
    assert opened == ["libcuda.so.1"]


def test_modules_are_unloaded_through_the_driver(driver):
    module, lib = driver
    calls = []
    lib.cuModuleUnload = type("Function", (), {"__call__": staticmethod(lambda handle: calls.append(handle) or 0)})()
    module.unload_module(77)
    assert calls == [77]
