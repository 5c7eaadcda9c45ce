"""Giving the GPU back: LLM.close(), `with LLM(...)` and garbage collection return every byte the cuda backend took
(weights, KV cache, buffers, graphs, pinned memory, cuBLAS handles, kernels), so that LLMs follow one another in
one process, each with the default KV cache of most of the GPU."""

import gc

import pytest

from tinyvllm import LLM, SamplingParams

pytestmark = pytest.mark.gpu

TOLERANCE = 64 << 20  # bytes of free memory a cycle may leave changed (the driver's own bookkeeping)
PARAMS = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
PROMPTS = [[1, 2, 3, 4], [5, 6, 7], list(range(10, 40))]
SETTINGS = dict(backend="cuda", max_num_seqs=16, max_model_len=512)  # the default gpu_memory_utilization


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Two different bf16 models: Llama-shaped, and Qwen3-shaped with other widths."""
    from tinyvllm.model.dummy import random_weights, save_hf_model_dir, tiny_config

    configs = {"llama": tiny_config(head_dim=64),
               "qwen3": tiny_config(architecture="Qwen3ForCausalLM", hidden_size=256, intermediate_size=512,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=128)}
    return {name: save_hf_model_dir(tmp_path_factory.mktemp(name), config, random_weights(config, 1),
                                    dtype="bfloat16")
            for name, config in configs.items()}


def free_bytes(cuda) -> int:
    cuda.Context.synchronize()
    return cuda.mem_get_info()[0]


def run_and_close(cuda, model, close) -> int:
    """Make an LLM, generate, check it holds most of the GPU, give it back with close(llm); free bytes before."""
    llm = LLM(model, **SETTINGS)
    outputs = llm.generate(PROMPTS, PARAMS)
    assert all(len(o.outputs[0].token_ids) == 8 for o in outputs)
    free, total = cuda.mem_get_info()
    assert free < 0.2 * total  # the KV cache took most of it
    close(llm)
    return free


@pytest.fixture
def baseline(cuda, models):
    """Free bytes after one LLM came and went (cuBLAS's and the driver's one-time allocations made)."""
    run_and_close(cuda, models["llama"], LLM.close)
    return free_bytes(cuda)


def test_close_gives_every_byte_back_five_times(cuda, models, baseline):
    for _ in range(5):
        llm = LLM(models["llama"], **SETTINGS)
        llm.generate(PROMPTS, PARAMS)  # lazy graph capture may still be running: close stops it
        device = llm.backend.device
        llm.close()
        assert device.closed and device.allocated_bytes == 0
        assert abs(free_bytes(cuda) - baseline) < TOLERANCE
        llm.close()  # idempotent


def test_two_models_one_after_the_other(cuda, models, baseline):
    for name in ("qwen3", "llama", "qwen3"):
        run_and_close(cuda, models[name], LLM.close)
        assert abs(free_bytes(cuda) - baseline) < TOLERANCE


def test_garbage_collection_gives_it_back(cuda, models, baseline):
    """A dropped LLM's memory comes back once it is collected; a new LLM collects what was dropped before it
    counts the free memory, so dropping one and making the next needs no close()."""
    llm = LLM(models["llama"], **SETTINGS)
    llm.generate(PROMPTS, PARAMS)
    del llm
    gc.collect()
    assert abs(free_bytes(cuda) - baseline) < TOLERANCE
    llm = LLM(models["qwen3"], **SETTINGS)
    llm.generate(PROMPTS, PARAMS)
    del llm  # no collection here: the next LLM's device does it
    run_and_close(cuda, models["llama"], LLM.close)
    gc.collect()
    assert abs(free_bytes(cuda) - baseline) < TOLERANCE


def test_with_llm_closes_it(cuda, models, baseline):
    from tinyvllm.backends.cuda.device import DeviceClosedError

    with LLM(models["qwen3"], **SETTINGS) as llm:
        llm.generate(PROMPTS, PARAMS)
    assert llm.closed and abs(free_bytes(cuda) - baseline) < TOLERANCE
    with pytest.raises(RuntimeError, match="this LLM is closed"):
        llm.generate(PROMPTS, PARAMS)
    with pytest.raises(DeviceClosedError, match="was closed"):  # a step reaching the backend stops before the memory
        llm.backend.decode_in.wait()


def test_close_right_after_start_stops_the_capture_thread(cuda, models, baseline):
    llm = LLM(models["llama"], **SETTINGS, cuda_graph_capture="lazy")
    capturer = llm.backend.graphs.capturer
    llm.close()
    assert capturer is not None and not capturer.thread.is_alive()
    assert abs(free_bytes(cuda) - baseline) < TOLERANCE
