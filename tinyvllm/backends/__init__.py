"""Backends: the model forward pass and sampling over the paged KV cache, behind one interface."""

from __future__ import annotations

import logging
import os
import shutil

from tinyvllm.backends.base import Backend, Batch, SamplerOutput, SamplingBatch, missing_cuda_kernels
from tinyvllm.config import EngineConfig, SettingError

log = logging.getLogger(__name__)

BACKEND_DTYPES = {"numpy": "float32", "cuda": "bfloat16"}  # what each computes in (EngineConfig.dtype must agree)


def cuda_available() -> bool:
    """True when pycuda imports and sees at least one NVIDIA GPU."""
    return cuda_unavailable_reason() is None


def cuda_unavailable_reason() -> str | None:
    """Why the cuda backend cannot run here (None: it can)."""
    try:
        import pycuda.driver as cuda
    except ImportError:
        if gpu_present():
            return "an NVIDIA GPU is present but pycuda is not installed (pip install 'tinyvllm[cuda]')"
        return "no NVIDIA GPU (pycuda is not installed)"
    try:
        cuda.init()
        count = cuda.Device.count()
    except Exception as exc:  # a driver that fails to start: say what it said
        return f"the CUDA driver did not start ({type(exc).__name__}: {exc})"
    return None if count > 0 else "pycuda sees no NVIDIA GPU"


def gpu_present() -> bool:
    """Whether this machine has an NVIDIA GPU, whatever Python can use of it."""
    return bool(shutil.which("nvidia-smi")) or os.path.exists("/dev/nvidia0")


def cuda_refusal(model_config, max_model_len: int | None) -> str | None:
    """Why the cuda backend does not run this model, though it runs here (None: it does): `auto` runs such a model
    on the numpy backend, `cuda` refuses it in this line."""
    scheme = model_config.quantization
    if scheme is not None and scheme.static_input:
        return (f"this is an FP8 checkpoint with static activation scales (quant_method {scheme.method}): the cuda "
                "backend quantizes activations per token; use backend numpy")
    return missing_cuda_kernels(model_config, max_model_len)


def create_backend(model, config: EngineConfig) -> Backend:
    """Build the backend config.backend ("auto" | "numpy" | "cuda") for a LoadedModel."""
    name = config.backend
    if config.quantize_lm_head and config.quantization != "fp8" and model.config.quantization is None:
        raise SettingError("invalid quantize_lm_head=True: the LM head is quantized only with FP8 weights "
                           "(quantization='fp8', or an FP8 checkpoint)")
    refusal = cuda_refusal(model.config, config.max_model_len)
    if name == "cuda":
        _refuse_fp8_weights(model)
        if refusal:
            raise ValueError(refusal)
    if name == "auto":
        reason = cuda_unavailable_reason() or refusal
        if reason is not None:  # said out loud only where a GPU was there to be used
            log.log(logging.WARNING if gpu_present() else logging.INFO,
                    "backend auto: running on the CPU (numpy): %s", reason)
        name = "numpy" if reason else "cuda"
    if config.dtype not in ("auto", BACKEND_DTYPES.get(name)):
        raise SettingError(f"invalid dtype={config.dtype!r}: the {name} backend computes in {BACKEND_DTYPES[name]}")
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


def _refuse_fp8_weights(model) -> None:
    """SettingError for an FP8 checkpoint the cuda backend would not run as quantized: it quantizes activations per
    token, so static input scales stay on the numpy backend."""
    scheme = model.config.quantization
    if scheme is not None and scheme.static_input:
        raise SettingError(f"{model.source} is an FP8 checkpoint with static activation scales (quant_method "
                           f"{scheme.method}): the cuda backend quantizes activations per token; use backend numpy")


__all__ = ["Backend", "Batch", "SamplerOutput", "SamplingBatch", "create_backend", "cuda_available"]
