"""Backends: the model forward pass and sampling over the paged KV cache, behind one interface."""

from __future__ import annotations

from tinyvllm.backends.base import Backend, Batch, SamplerOutput, SamplingBatch
from tinyvllm.config import EngineConfig

BACKEND_DTYPES = {"numpy": "float32", "cuda": "bfloat16"}  # what each computes in (EngineConfig.dtype must agree)


def cuda_available() -> bool:
    """True when pycuda imports and sees at least one NVIDIA GPU."""
    try:
        import pycuda.driver as cuda

        cuda.init()
        return cuda.Device.count() > 0
    except Exception:  # no pycuda, no driver, no device: all mean "no"
        return False


def create_backend(model, config: EngineConfig) -> Backend:
    """Build the backend config.backend ("auto" | "numpy" | "cuda") for a LoadedModel."""
    name = config.backend
    if name == "auto":
        name = "cuda" if cuda_available() else "numpy"
    if config.dtype not in ("auto", BACKEND_DTYPES.get(name)):
        raise ValueError(f"invalid dtype={config.dtype!r}: the {name} backend computes in {BACKEND_DTYPES[name]}")
    if name == "numpy":
        from tinyvllm.backends.numpy_backend import NumpyBackend

        return NumpyBackend(model, config)
    if name == "cuda":
        try:
            from tinyvllm.backends.cuda.runner import CudaBackend
        except ImportError as exc:
            raise RuntimeError(f"the cuda backend needs pycuda and an NVIDIA GPU ({exc}); "
                               "install with `pip install tinyvllm[cuda]` or use --backend numpy") from exc
        return CudaBackend(model, config, use_graphs=not config.enforce_eager)
    raise ValueError(f"unknown backend {name!r}: choose auto, numpy or cuda")


__all__ = ["Backend", "Batch", "SamplerOutput", "SamplingBatch", "create_backend", "cuda_available"]
