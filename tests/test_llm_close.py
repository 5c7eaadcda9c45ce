"""Giving a backend's memory back: Backend.close(), LLM.close() and `with LLM(...) as llm:`, on the numpy backend
(tests/gpu/test_close.py measures the cuda backend's device memory)."""

import pytest

from tinyvllm import LLM, SamplingParams
from tinyvllm.backends.base import Backend

PARAMS = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


def test_numpy_backend_close_frees_its_kv_cache(tiny_model_dir):
    llm = LLM(tiny_model_dir, backend="numpy", max_num_seqs=2)
    backend = llm.backend
    assert backend.k_cache and backend.v_cache
    llm.generate("Hello", PARAMS)
    llm.close()
    assert backend.k_cache == [] and backend.v_cache == []
    llm.close()  # idempotent
    assert llm.closed


def test_a_closed_llm_refuses_to_generate_in_one_line(tiny_model_dir):
    llm = LLM(tiny_model_dir, backend="numpy", max_num_seqs=2)
    llm.close()
    for use in (lambda: llm.generate("Hello", PARAMS), lambda: llm.chat([{"role": "user", "content": "hi"}])):
        with pytest.raises(RuntimeError, match=r"^this LLM is closed \(close\(\) gave its device memory back\): "
                                               r"create a new LLM$"):
            use()


def test_with_llm_closes_it_on_the_way_out(tiny_model_dir):
    with LLM(tiny_model_dir, backend="numpy", max_num_seqs=2) as llm:
        assert not llm.closed
        assert llm.generate("Hello", PARAMS)[0].outputs[0].token_ids
    assert llm.closed and llm.backend.k_cache == []
    with pytest.raises(ZeroDivisionError):
        with LLM(tiny_model_dir, backend="numpy", max_num_seqs=2) as failing:
            raise ZeroDivisionError  # an error inside the block closes it too, and goes on up
    assert failing.closed


def test_the_default_backend_close_is_a_no_op():
    class Minimal(Backend):
        name, vocab_size = "minimal", 1

        def init_kv_cache(self):
            return 1

        def execute(self, batch, bitmask=None):
            raise NotImplementedError

    Minimal().close()
