"""Backend selection: `auto` says why it runs on the CPU when a GPU was there to be used."""

import builtins
import logging

from tinyvllm import backends
from tinyvllm.config import EngineConfig
from tinyvllm.model.dummy import random_weights, tiny_config
from tinyvllm.model.loader import LoadedModel


def test_auto_says_why_it_falls_back_to_the_cpu(monkeypatch, caplog):
    real_import = builtins.__import__

    def no_pycuda(name, *args, **kwargs):
        if name.startswith("pycuda"):
            raise ImportError("No module named 'pycuda'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_pycuda)
    monkeypatch.setattr(backends, "gpu_present", lambda: True)
    config = tiny_config()
    model = LoadedModel(config, random_weights(config), None, "dummy")
    with caplog.at_level(logging.INFO, logger="tinyvllm.backends"):
        backend = backends.create_backend(model, EngineConfig(backend="auto", max_model_len=64))
    assert backend.name == "numpy"
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "GPU is present but pycuda is not installed" in warnings[0].getMessage()


def test_auto_is_quiet_without_a_gpu(monkeypatch, caplog):
    monkeypatch.setattr(backends, "cuda_unavailable_reason", lambda: "no NVIDIA GPU (pycuda is not installed)")
    monkeypatch.setattr(backends, "gpu_present", lambda: False)
    config = tiny_config()
    model = LoadedModel(config, random_weights(config), None, "dummy")
    with caplog.at_level(logging.INFO, logger="tinyvllm.backends"):
        assert backends.create_backend(model, EngineConfig(max_model_len=64)).name == "numpy"
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
