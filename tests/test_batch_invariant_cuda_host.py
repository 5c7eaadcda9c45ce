"""batch_invariant=True on the cuda backend's host side, without a GPU: on a stand-in device every linear layer of a
decode step and of a prefill goes to the (invariant) cuBLAS handle and none to a GEMV, a decode step's attention is
attention_prefill over one query per sequence with the block tables' full width, the LM head is not tuned per
batch size, and an expert model is refused in one line. The bits themselves: tests/gpu/test_batch_invariant_cuda.py."""

import numpy as np
import pytest

from tinyvllm.backends.cuda.linear import Linear
from tinyvllm.backends.cuda.ops import PREFILL_BLOCK_M, Ops, prefill_tiles

from test_cuda_ops import FakeBuffers, FakeDevice, FakeStream, RecordingBlas, TypedRecorder, forward_module  # noqa: F401


def invariant_forward(forward_module, recorder, **overrides):
    from tinyvllm.config import EngineConfig
    from tinyvllm.model.dummy import random_weights, tiny_config
    from tinyvllm.model.loader import LoadedModel

    config = tiny_config(head_dim=64, **overrides)
    engine = EngineConfig(block_size=16, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=128,
                          num_kv_blocks=8, batch_invariant=True)
    return forward_module.CudaForward(LoadedModel(config, random_weights(config), None, "random"), engine,
                                      FakeDevice(recorder), FakeStream(), 16)


@pytest.mark.parametrize("sliding_window", [None, 24])
def test_decode_runs_prefill_attention_and_no_gemv(forward_module, sliding_window):
    recorder = TypedRecorder()
    extra = {"architecture": "MistralForCausalLM", "sliding_window": sliding_window} if sliding_window else {}
    forward = invariant_forward(forward_module, recorder, **extra)
    assert forward.blas.invariant and forward.linear.invariant
    forward.allocate_kv_cache(8)
    assert forward.tune_lm_head([1, 2, 4, 128]) == {}
    buffers = FakeBuffers()
    forward.decode(3, buffers, buffers, buffers)
    names = [name for name, _, _ in recorder.launches]
    assert not any(name.startswith(("gemv", "attention_decode", "attention_combine")) for name in names), names
    attention = [(grid, args) for (name, grid, _), args in zip(recorder.launches, recorder.args)
                 if name.startswith("attention_prefill")]
    assert len(attention) == forward.config.num_hidden_layers
    tiles = forward.decode_tiles
    for grid, args in attention:
        assert grid == (3 * tiles.tiles_per_seq, forward.kv_heads)
        assert args[5] == tiles.bt_width == 128 // 16  # the block tables' full width
        assert args[6] == tiles.query_start_loc.ptr and args[8:10] == (tiles.tile_seq.ptr, tiles.tile_row0.ptr)
    windows = {args[-2] for _, args in attention}
    assert windows == {sliding_window or 0}
    # every product of the step (QKV, O, gate/up, down per layer, the LM head) through cuBLAS at 3 rows
    calls = forward.linear.blas.calls
    assert len(calls) == 4 * forward.config.num_hidden_layers + 1 and {m for *_, m, _ in calls} == {3}
    recorder.launches.clear()
    forward.prefill(10, buffers, buffers, 3, 2)
    assert not any(name.startswith("gemv") for name, _, _ in recorder.launches)


def test_decode_tiles_are_one_query_per_sequence(forward_module):
    forward = invariant_forward(forward_module, TypedRecorder(), num_attention_heads=4, num_key_value_heads=2)
    seqs, rows = prefill_tiles(np.full(4, forward.group))
    assert forward.decode_tiles.tiles_per_seq == -(-forward.group // PREFILL_BLOCK_M) == len(seqs) // 4
    assert list(seqs) == [0, 1, 2, 3] and list(rows) == [0] * 4


def test_an_expert_model_is_refused(forward_module):
    with pytest.raises(ValueError, match="batch_invariant on the cuda backend does not cover expert"):
        invariant_forward(forward_module, TypedRecorder(), architecture="Qwen3MoeForCausalLM", num_experts=4,
                          num_experts_per_tok=2, moe_intermediate_size=64)


def test_invariant_linear_needs_an_invariant_blas():
    with pytest.raises(ValueError, match="batch-invariant cuBLAS handle"):
        Linear(RecordingBlas(), Ops(TypedRecorder(), None, num_sms=132), invariant=True)
    linear = Linear(RecordingBlas(invariant=True), Ops(TypedRecorder(), None, num_sms=132), invariant=True)
    assert not linear.uses_gemv(1, 2048, 2048)
