"""Shared fixtures: tiny random HF model dirs, the kill tests' reference run, and the fetched default model (skipped
when absent); the helpers they use are in helpers.py. The `slow` marks of `make test-fast` (SLOW), and the `model`
mark of every test that needs the default model."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import cli, job_args, make_input, tiny_model

from tinyvllm import fetch

# The tests `make test-fast` leaves out (marked `slow` here, in one place, beside those marked in their files): test
# file -> its slow test functions, or "*" for all of them. Local Ray clusters, the HF torch references, subprocess
# kill-and-resume runs and other end-to-end runs of several seconds each.
SLOW: dict[str, set[str] | str] = {
    "test_ray.py": "*",
    "test_numpy_vs_hf.py": "*",
    "test_request_surface.py": {"test_ray_job_carries_columns_and_request_fields"},
    "test_cli.py": {"test_sigkill_and_resume_exactly_once", "test_signal_stops_then_resume_checks_manifest"},
    "test_reliability.py": {"test_lock_removed_mid_run"},
}
TESTS = Path(__file__).resolve().parent


@pytest.hookimpl(tryfirst=True)  # before -m deselects by mark
def pytest_collection_modifyitems(config, items) -> None:
    """Mark SLOW's tests `slow`, and those using the default model `model`."""
    checked: set[Path] = set()
    for item in items:
        if "default_model_path" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.model)
        path = Path(str(item.fspath))
        slow = SLOW.get(path.name) if path.parent == TESTS else None
        if slow is None:
            continue
        if path not in checked:
            checked.add(path)
            _check_names(item.module, path.name, slow)
        if slow == "*" or getattr(item, "originalname", item.name) in slow:
            item.add_marker(pytest.mark.slow)


def _check_names(module, file_name: str, slow: set[str] | str) -> None:
    """A SLOW name that is no test of its file is an error: a renamed test would join the fast lane unnoticed."""
    missing = sorted(name for name in (() if slow == "*" else slow) if not hasattr(module, name))
    if missing:
        raise pytest.UsageError(f"conftest.SLOW names tests {file_name} does not have: {', '.join(missing)}")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """tiny_config() with random_weights(seed=0), float32, saved once per session. Treat as read-only."""
    return tiny_model(tmp_path_factory.mktemp("tiny_model"))


@pytest.fixture
def make_model_dir(tmp_path_factory):
    """make_model_dir(dtype="float32", shards=1, seed=0, **tiny_config_overrides) -> a fresh model dir (tiny_model)."""

    def make(**kwargs) -> Path:
        return tiny_model(tmp_path_factory.mktemp("model"), **kwargs)

    return make


@pytest.fixture(scope="module")
def reference(tiny_model_dir, tmp_path_factory) -> tuple[Path, pa.Table]:
    """The kill tests' input (make_input, 150 rows) and the output of an uninterrupted run over it."""
    tmp = tmp_path_factory.mktemp("reference")
    src, out = make_input(tmp / "in.jsonl", 150), tmp / "ref.parquet"
    proc = cli(*job_args(tiny_model_dir, src, out))
    assert proc.wait() == 0, proc.communicate()[1]
    return src, pq.read_table(out)


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    path = fetch.default_model_path()
    if path is None:
        pytest.skip(
            f"default model not fetched (no {fetch.DEFAULT_MODEL_FILE} in {fetch.default_model_cache_dir()}); "
            "run `tinyvllm fetch-default-model`"
        )
    return path
