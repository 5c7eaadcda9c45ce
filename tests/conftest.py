"""Shared fixtures: tiny random HF model dirs, and the fetched default model (skipped when absent)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tinyvllm import fetch
from tinyvllm.model.dummy import random_weights, save_hf_model_dir, tiny_config


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """tiny_config() with random_weights(seed=0), float32, saved once per session. Treat as read-only."""
    config = tiny_config()
    return save_hf_model_dir(tmp_path_factory.mktemp("tiny_model"), config, random_weights(config))


@pytest.fixture
def make_model_dir(tmp_path_factory):
    """make_model_dir(dtype="float32", shards=1, seed=0, **tiny_config_overrides) -> a fresh model dir.

    Its weights are random_weights(tiny_config(**overrides), seed) (stored in `dtype`)."""

    def make(*, dtype: str = "float32", shards: int = 1, seed: int = 0, **overrides) -> Path:
        config = tiny_config(**overrides)
        path = tmp_path_factory.mktemp("model")
        return save_hf_model_dir(path, config, random_weights(config, seed), dtype=dtype, shards=shards)

    return make


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    path = fetch.default_model_path()
    if path is None:
        pytest.skip(
            f"default model not fetched (no {fetch.DEFAULT_MODEL_FILE} in {fetch.default_model_cache_dir()}); "
            "run `tinyvllm fetch-default-model`"
        )
    return path
