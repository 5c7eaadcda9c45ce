"""Start-up's kernels on the GPU: on an empty kernel cache `LLM()` builds only its model's kernels, on a thread while
the weights upload, and generates what it generates with the cache warm; a kernel outside that set is built and
loaded at its first lookup."""

import pytest

from tinyvllm import LLM, SamplingParams

pytestmark = pytest.mark.gpu

PARAMS = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
PROMPTS = [[1, 2, 3, 4], list(range(10, 60))]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from tinyvllm.model.dummy import random_weights, save_hf_model_dir, tiny_config

    config = tiny_config(head_dim=64)
    return save_hf_model_dir(tmp_path_factory.mktemp("llama"), config, random_weights(config, 3),
                             dtype="bfloat16"), config


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    """A fresh kernel cache, and nothing built in this process yet."""
    from tinyvllm.backends.cuda import kernels

    monkeypatch.setenv("TINYVLLM_KERNEL_CACHE", str(tmp_path / "kernels"))
    monkeypatch.setattr(kernels, "_built", {})
    return tmp_path / "kernels"


def tokens(llm) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, PARAMS)]


def test_a_cold_start_builds_only_the_models_kernels_and_generates_as_a_warm_one(model, empty_cache, monkeypatch):
    from tinyvllm.backends.cuda import kernels
    from tinyvllm.backends.cuda.kernel_cache import job_name

    path, config = model
    needed = kernels.needed_kernels(config.head_dim, config.num_attention_heads, config.num_key_value_heads, False)
    with LLM(path, backend="cuda", max_model_len=256) as cold:
        cold_tokens = tokens(cold)
        device = cold.backend.device
        assert set(device.kernels.modules) == {job_name(name) for name in needed}  # nothing else was launched
        assert cold.backend.startup_times["kernels"] == pytest.approx(device.kernel_wait)
        assert len(list(empty_cache.glob("*.cubin"))) == len(device.kernels.modules)
    monkeypatch.setattr(kernels, "_built", {})  # the next one reads the cache
    with LLM(path, backend="cuda", max_model_len=256) as warm:
        assert tokens(warm) == cold_tokens


def test_a_kernel_outside_the_prepared_ones_loads_at_its_first_lookup(empty_cache):
    from tinyvllm.backends.cuda.device import Device
    from tinyvllm.backends.cuda.kernels import Kernel

    device = Device(0, prepare=["rms_norm"])  # building from before the context is made
    try:
        assert set(device.kernels.modules) == {"norm"} and device.kernel_wait > 0
        assert isinstance(device.kernels["attention_decode_d128_r16"], Kernel)
        assert set(device.kernels.modules) == {"norm", "attention_decode_d128_r16"}
    finally:
        device.close()
    assert device.closed
