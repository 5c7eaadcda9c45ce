"""bench/profile_host.py on the GPU at a tiny scale: every phase is found on the cuda backend, each decode step
gets its GPU time, graph replay and idle gap, and the profiled steps give the tokens unprofiled ones do."""

from pathlib import Path

import numpy as np
import pytest

from helpers import load_script

pytestmark = pytest.mark.gpu

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "profile_host.py"
SMALL = ["--dummy-weights", "smollm2-135m", "--num-kv-blocks", "512", "--prompt-len", "16"]


@pytest.fixture(scope="module")
def profile_host():
    return load_script(SCRIPT, "profile_host_gpu")


def test_steady_decode_and_workloads(device, profile_host, tmp_path):
    results = profile_host.main([*SMALL, "--batch", "4,1", "--steps", "6", "--warmup", "2", "--workloads",
                                 "W1,W3,J1", "--scale", "0.02", "--j1-rows", "8", "--json",
                                 str(tmp_path / "host.json")])
    for batch in ("4", "1"):
        steady = results["batches"][batch]
        assert steady["phases_not_found"] == []
        host, gpu = steady["decode"]["host_ms"], steady["gpu"]
        for name in ("engine step", "schedule", "prepare", "build_batch", "submit", "stage decode", "fill sampling",
                     "upload decode_in", "graph launch", "download", "wait for sampled ids", "output processing"):
            assert host[name]["median"] >= 0, name
        assert gpu["step_ms"]["n"] == 6 and gpu["replay_ms"]["n"] == 6 and gpu["idle_gap_ms"]["n"] == 5
        assert 0 < gpu["replay_ms"]["median"] <= gpu["step_ms"]["median"]
        assert gpu["idle_gap_ms"]["median"] >= 0 and 0 <= gpu["idle_share"] < 1
    for name in ("W1", "W3", "J1"):
        work = results["workloads"][name]
        assert work["phases_not_found"] == [] and work["prefill"]["steps"] >= 1 and work["decode"]["steps"] >= 1
        assert work["gpu"]["step_ms"]["n"] >= work["decode"]["steps"] and work["gpu"]["busy_total_ms"] > 0


def test_profiling_keeps_the_tokens(device, profile_host):
    """The wrapped phases and the events between steps change no output."""
    from tinyvllm import SamplingParams
    args = profile_host.parse_args([*SMALL, "--batch", "1"])
    llm = profile_host.make_llm(args, 8)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 49152, int(rng.integers(4, 40))).tolist() for _ in range(6)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    got = []
    profile_host.profiled(llm, lambda: got.extend(o.outputs[0].token_ids for o in llm.generate(prompts, params)))
    llm.backend.close()
    assert got == want
