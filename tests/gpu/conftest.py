"""GPU tests need pycuda and an NVIDIA GPU; without them every test marked `gpu` is skipped, saying which is missing.

Test modules import nothing that needs pycuda at import time: they get it from the fixtures below.
"""

from __future__ import annotations

import pytest


def _missing() -> str | None:
    try:
        import pycuda.driver as cuda
    except ImportError as exc:
        return f"pycuda is not installed ({exc}); pip install tinyvllm[cuda]"
    try:
        cuda.init()
        if cuda.Device.count() == 0:
            return "no NVIDIA GPU visible to the CUDA driver"
    except cuda.Error as exc:
        return f"the CUDA driver is unusable: {exc}"
    return None


MISSING = _missing()


def pytest_collection_modifyitems(config, items):
    if MISSING is None:
        return
    skip = pytest.mark.skip(reason=MISSING)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def device():
    """Device 0 for the session (its primary context current: shared with cuBLAS, torch and every backend's)."""
    if MISSING:
        pytest.skip(MISSING)
    from tinyvllm.backends.cuda.device import Device

    opened = Device(0)
    yield opened
    opened.close()


@pytest.fixture(scope="session")
def cuda(device):
    """pycuda.driver, on the device's primary context."""
    import pycuda.driver

    return pycuda.driver


@pytest.fixture(scope="session")
def kernels(device):
    return device.kernels


@pytest.fixture(scope="session")
def ops(kernels):
    """The backend's launchers, on the default stream."""
    from tinyvllm.backends.cuda.ops import Ops

    return Ops(kernels, None)


@pytest.fixture(scope="session")
def cuda_backend(cuda):
    """The CudaBackend class."""
    from tinyvllm.backends.cuda.runner import CudaBackend

    return CudaBackend
