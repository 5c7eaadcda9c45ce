"""Write a Llama-3.2-1B-shaped model dir of random bf16 values (tiled: all that timing start-up needs), once.

    python bench/write_llama_1b.py DIR      # ~2.5 GB; nothing is done if DIR/model.safetensors exists
"""

import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tinyvllm.model import dummy  # noqa: E402
from tinyvllm.model.loader import weight_shapes  # noqa: E402


def main(directory: str) -> None:
    if (Path(directory) / "model.safetensors").is_file():
        return
    start = time.perf_counter()
    config = dummy.llama_3_2_1b_config()
    tile = np.random.default_rng(0).standard_normal(1 << 22, dtype=np.float32) * np.float32(0.02)
    weights = {name: np.resize(tile, shape) + np.float32(len(shape) == 1)  # norm gains near 1
               for name, shape in weight_shapes(config).items() if name != "lm_head.weight"}  # tied
    dummy.save_hf_model_dir(directory, config, weights, dtype="bfloat16")
    print(f"wrote {directory} in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main(sys.argv[1])
