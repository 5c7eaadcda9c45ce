"""batch_invariant=True on the cuda backend's host side, without a GPU: on a stand-in device every linear layer of a
decode step goes to the (invariant) cuBLAS handle, or to gemv_chain for the shapes whose bits it was checked to give
and where it was timed the faster, and none to the GEMV, whose order differs; attention is the batch-invariant
forms (attention_decode's, in parts of whole chunks at small batches merged by attention_combine_inv, never by the
other merges; attention_prefill's), the LM head is not tuned per batch size, and an expert model is refused in one
line. The bits themselves: tests/gpu/test_batch_invariant_cuda.py."""

import pytest

from tinyvllm.backends.cuda.linear import Linear
from tinyvllm.backends.cuda.ops import INVARIANT_PARTS, Ops, decode_blocks

from test_cuda_ops import (FakeBuffers, FakeDevice, FakeGraph, FakeStream, RecordingBlas, TypedRecorder,  # noqa: F401
                           engine_config_for, forward_module, graphs_module)


@pytest.fixture(autouse=True)
def no_chain_by_default(forward_module, monkeypatch):
    """The stand-in device computes nothing: gemv_chain's check against cuBLAS fails unless a test says otherwise."""
    monkeypatch.setattr(forward_module.CudaForward, "_chain_matches", lambda self, w, tile_rows=16: False)


def invariant_forward(forward_module, recorder, num_sms=132, **overrides):
    from tinyvllm.config import EngineConfig
    from tinyvllm.model.dummy import random_weights, tiny_config
    from tinyvllm.model.loader import LoadedModel

    config = tiny_config(head_dim=64, **overrides)
    engine = EngineConfig(block_size=16, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=128,
                          num_kv_blocks=8, batch_invariant=True)
    device = FakeDevice(recorder)
    device.num_sms = num_sms
    return forward_module.CudaForward(LoadedModel(config, random_weights(config), None, "random"), engine, device,
                                      FakeStream(), 16)


@pytest.mark.parametrize("sliding_window", [None, 24])
def test_decode_runs_invariant_attention_and_pinned_gemms(forward_module, sliding_window):
    recorder = TypedRecorder()
    extra = {"architecture": "MistralForCausalLM", "sliding_window": sliding_window} if sliding_window else {}
    forward = invariant_forward(forward_module, recorder, **extra)
    assert forward.blas.invariant and forward.linear.invariant
    forward.allocate_kv_cache(8)
    assert forward.tune_lm_head([1, 2, 4, 128]) == {}
    buffers = FakeBuffers()
    forward.decode(3, buffers, buffers, buffers)
    names = [name for name, _, _ in recorder.launches]
    assert not any(name.startswith("attention_prefill") or name.startswith("attention_combine")
                   and name != "attention_combine_inv" or name.startswith("gemv") and "chain" not in name
                   for name in names), names
    splits = forward.num_splits(3)
    assert splits > 1 and names.count("attention_combine_inv") == forward.config.num_hidden_layers
    assert forward.buf.partial_o.shape[0] >= 3 * forward.heads * INVARIANT_PARTS
    # sampling and logprobs a block a row, at 3 rows too (a row split over a cluster adds in another order)
    forward.logprobs(3, buffers.ptr("ids"), 2, (buffers.ptr("lp"), 8, 12))
    sampling = [(name, grid) for name, grid, _ in recorder.launches if name.startswith(("sample", "logprobs"))]
    assert sampling == [("sample", (3,)), ("logprobs", (3,))]
    attention = [(name, grid, block, args) for (name, grid, block), args in zip(recorder.launches, recorder.args)
                 if name.startswith("attention_decode")]
    assert len(attention) == forward.config.num_hidden_layers
    for name, grid, block, args in attention:
        assert name == "attention_decode_d64_r8_inv"
        # a warp per (sequence, KV head, part)
        assert grid == (decode_blocks(forward.kv_heads, forward.group, 64, invariant=True), 3, splits) == (2, 3, splits)
        assert block == (32, 1, 1) and args[14] == splits
    windows = {args[15] for *_, args in attention}
    assert windows == {sliding_window or 0}
    # every product of the step (QKV, O, gate/up, down per layer, the LM head) through cuBLAS at 3 rows where the
    # chain's bits were not cuBLAS's
    assert forward.linear.chain_shapes == set() and not any("chain" in name for name in names)
    calls = forward.linear.blas.calls
    assert len(calls) == 4 * forward.config.num_hidden_layers + 1 and {m for *_, m, _ in calls} == {3}
    recorder.launches.clear()
    forward.prefill(10, buffers, buffers, 3, 2)
    assert not any(name.startswith("gemv") for name, _, _ in recorder.launches)
    prefill = [name for name, _, _ in recorder.launches if name.startswith("attention")]
    assert prefill == ["attention_prefill_d64_inv"] * forward.config.num_hidden_layers


def test_a_full_batch_decodes_in_one_part(forward_module):
    """Where the batch fills the GPU, the invariant form runs each context in one part, with no merge."""
    recorder = TypedRecorder()
    forward = invariant_forward(forward_module, recorder, num_sms=1)
    forward.allocate_kv_cache(8)
    assert forward.num_splits(4) == 1
    forward.decode(4, FakeBuffers(), FakeBuffers(), FakeBuffers())
    attention = [(name, grid) for name, grid, _ in recorder.launches if name.startswith("attention")]
    assert attention == [("attention_decode_d64_r8_inv", (2, 4, 1))] * forward.config.num_hidden_layers


def step_costs(forward_module, monkeypatch, costs):
    """A step_with for CudaForward.choose_chain_shapes whose steps record their chain shapes (chain, chain8), and an
    _elapsed that gives each step 10 ms plus, for each shape of `costs` ({form: ms}), the cost of the form it runs in
    ("chain8", "chain" or "cuBLAS"): returns the step_with and the list of ((chain, chain8), timed) each run
    appends to."""
    runs = []

    def step_with(chain, chain8):
        return lambda: runs.append(((chain, chain8), False))

    def form(shape, chain, chain8):
        return "chain8" if shape in chain8 else "chain" if shape in chain else "cuBLAS"

    def elapsed(self, run):
        run()
        sets, _ = runs[-1]
        runs[-1] = (sets, True)
        return 10.0 + sum(forms[form(shape, *sets)] for shape, forms in costs.items())

    monkeypatch.setattr(forward_module.CudaForward, "_elapsed", elapsed)
    return step_with, runs


def test_decode_runs_gemv_chain_for_the_checked_shapes(forward_module, monkeypatch):
    """The shapes: QKV and the LM head [512, 64], gate/up [256, 64], O [64, 256], down [64, 128]. gate/up's chain is
    made to differ from cuBLAS (so it is never a candidate), O's to make a step slower: QKV, down and the LM head
    take it."""
    checked = []

    def matches(self, w, tile_rows=16):
        checked.append((w.shape, tile_rows))
        return w.shape != (256, 64) and tile_rows == 16

    monkeypatch.setattr(forward_module.CudaForward, "_chain_matches", matches)
    recorder = TypedRecorder()
    forward = invariant_forward(forward_module, recorder, num_sms=8, num_attention_heads=4, num_key_value_heads=2)
    # gate/up [256, 64] is gated (16-row tiles only); the LM head shares QKV's shape
    assert sorted(checked) == sorted([(s, 8) for s in [(512, 64), (64, 256), (64, 128)]]
                                     + [(s, 16) for s in [(64, 128), (64, 256), (256, 64), (512, 64)]])
    assert forward.linear.chain_shapes == {(512, 64), (64, 128), (64, 256)}  # every candidate, until timed
    assert forward.chain8_candidates == set()
    step_with, _ = step_costs(forward_module, monkeypatch, {(64, 256): {"chain": 2.0, "cuBLAS": 1.0},
                                                            (512, 64): {"chain": 1.0, "cuBLAS": 2.0},
                                                            (64, 128): {"chain": 1.0, "cuBLAS": 1.5}})
    forward.choose_chain_shapes(step_with)
    assert forward.linear.chain_shapes == {(512, 64), (64, 128)}
    forward.allocate_kv_cache(8)
    buffers = FakeBuffers()
    forward.decode(3, buffers, buffers, buffers)
    chains = [(name, args) for (name, _, _), args in zip(recorder.launches, recorder.args) if "chain" in name]
    layers = forward.config.num_hidden_layers
    assert [name for name, _ in chains] == ["gemv_chain_bf16", "gemv_chain_f32"] * layers + ["gemv_chain_f32"]
    assert {args[3] for _, args in chains} == {3}
    calls = forward.linear.blas.calls  # O and gate/up
    assert len(calls) == 2 * layers and {m for *_, m, _ in calls} == {3}
    other = forward.on_stream(FakeStream())
    assert other.linear.chain_shapes == {(512, 64), (64, 128)}


def test_the_chain_is_kept_where_whole_steps_run_faster(forward_module, monkeypatch):
    """choose_chain_shapes takes the candidates in order: for each, a step without its chain and with it in each tile
    it may run in (the other shapes as chosen so far) run once untimed, then CHAIN_STEP_RUNS times each, alternating;
    the least median decides, a tie for cuBLAS, and the medians are kept in chain_timings."""
    forward = invariant_forward(forward_module, TypedRecorder())
    forward.linear.chain_shapes = {(1, 16), (2, 16), (3, 16)}
    forward.chain8_candidates = {(2, 16), (4, 16)}
    costs = {(1, 16): {"chain": 1.0, "cuBLAS": 3.0}, (2, 16): {"chain": 5.0, "chain8": 1.0, "cuBLAS": 2.0},
             (3, 16): {"chain": 4.0, "cuBLAS": 4.0}, (4, 16): {"chain8": 3.0, "cuBLAS": 2.0}}
    step_with, runs = step_costs(forward_module, monkeypatch, costs)
    forward.choose_chain_shapes(step_with)
    assert forward.linear.chain_shapes == {(1, 16), (2, 16)} and forward.linear.chain8_shapes == {(2, 16)}
    n = forward_module.CHAIN_STEP_RUNS
    a, b, c, d = (1, 16), (2, 16), (3, 16), (4, 16)
    expected = []
    for variants in ([({b, c}, set()), ({a, b, c}, set())],  # a: cuBLAS, chain
                     [({a, c}, set()), ({a, b, c}, set()), ({a, b, c}, {b})],  # b: cuBLAS, chain, chain8
                     [({a, b}, {b}), ({a, b, c}, {b})],  # c: a tie, cuBLAS
                     [({a, b}, {b}), ({a, b, d}, {b, d})]):  # d: cuBLAS
        variants = [(frozenset(chain), frozenset(chain8)) for chain, chain8 in variants]
        expected += [(v, False) for v in variants] + [(v, True) for v in variants] * n
    assert runs == expected
    assert forward.chain_timings == {a: {"cuBLAS": 10 + 3 + 5 + 4 + 2, "chain": 10 + 1 + 5 + 4 + 2},
                                     b: {"cuBLAS": 10 + 1 + 2 + 4 + 2, "chain": 10 + 1 + 5 + 4 + 2,
                                         "chain8": 10 + 1 + 1 + 4 + 2},
                                     c: {"cuBLAS": 10 + 1 + 1 + 4 + 2, "chain": 10 + 1 + 1 + 4 + 2},
                                     d: {"cuBLAS": 10 + 1 + 1 + 4 + 2, "chain8": 10 + 1 + 1 + 4 + 3}}


@pytest.mark.parametrize("graphs", [None, "eager"])
def test_the_backend_chooses_its_chains_by_timing_batch_1_steps_before_its_graphs(forward_module, make_model_dir,
                                                                                  monkeypatch, graphs):
    """At start-up (the KV cache allocated, no decode graph captured yet) an invariant CudaBackend times batch-1
    decode steps on a padding row, each a graph of its own (released after) or, without graphs, queued eagerly; the
    shapes chosen are those the decode graphs then capture, and the time shows among the start-up phases."""
    import dataclasses
    import importlib

    from tinyvllm.model.loader import load_model

    runner = importlib.import_module("tinyvllm.backends.cuda.runner")
    monkeypatch.setattr(forward_module.CudaForward, "_chain_matches", lambda self, w, tile_rows=16: tile_rows == 16)
    FakeGraph.made = []
    recorder = TypedRecorder()
    timed, staged = [], []

    class NamingGraph(FakeGraph):  # what it captured
        def __init__(self, stream_handle, record):
            before = len(recorder.launches)
            super().__init__(stream_handle, record)
            self.names = [name for name, _, _ in recorder.launches[before:]]

    def elapsed(self, run):  # a step whose QKV (the only bf16-out product) runs the chain takes 1 ms, any other 2
        inp = backend_inputs[0]
        staged.append((inp["context_lens"][0], inp["slot_mapping"][0], inp["bt_stride"][0], inp["block_tables"][0]))
        before, replays = len(recorder.launches), [g.launches for g in FakeGraph.made]
        run()
        names = [name for name, _, _ in recorder.launches[before:]]
        timed.append(names)
        replayed = [g for g, count in zip(FakeGraph.made, replays) if g.launches > count]
        ran = replayed[0].names if replayed else names
        return 1.0 if "gemv_chain_bf16" in ran else 2.0

    backend_inputs = []
    monkeypatch.setattr(graphs_module(), "Graph", NamingGraph)
    monkeypatch.setattr(forward_module.CudaForward, "_elapsed", elapsed)
    original = runner.CudaBackend._choose_chain_shapes

    def choose(self):
        backend_inputs.append(self.decode_in)
        original(self)

    monkeypatch.setattr(runner.CudaBackend, "_choose_chain_shapes", choose)
    model = load_model(make_model_dir(head_dim=64))
    config = dataclasses.replace(engine_config_for(model, graphs), batch_invariant=True)
    backend = runner.CudaBackend(model, config, use_graphs=graphs is not None, device=FakeDevice(recorder))
    backend.init_kv_cache()
    forward = backend.forward
    qkv = forward.layers[0].qkv.shape
    assert forward.linear.chain_shapes == {qkv} and set(forward.chain_timings) == {
        w.shape for w in (forward.layers[0].qkv, forward.layers[0].o, forward.layers[0].gate_up,
                          forward.layers[0].down, forward.lm_head)}
    assert staged and set(staged) == {(1, -1, 1, 0)}  # a one-token context, no KV slot written, block 0
    assert "gemv_chain choice" in backend.startup_times
    if graphs is None:
        assert all(names for names in timed)  # eager steps
    else:
        assert all(not names for names in timed)  # graph replays
        temporary = [g for g in FakeGraph.made if g.closed]
        # one graph per set of chain shapes: every candidate's, then each shape's without it (the set kept is
        # captured already when the next shape is timed with its chain)
        assert len(temporary) == 1 + len(forward.chain_timings) and all(g.launches for g in temporary)
        assert sorted(backend.graphs.sampled) == backend.graphs.buckets  # captured after, with QKV's chain alone
        chains = (["gemv_chain_bf16"] * forward.config.num_hidden_layers  # QKV's; the LM head's if it has QKV's shape
                  + ["gemv_chain_f32"] * (forward.lm_head.shape == qkv))
        assert all(not g.closed and [name for name in g.names if "chain" in name] == chains
                   for g in backend.graphs.sampled.values())
    backend.close()


def test_invariant_decode_attention_parts_fit_the_slots():
    """The invariant parts write a chunk's state each to INVARIANT_PARTS slots of a (sequence, head): more parts
    than slots are refused; within them the merge is attention_combine_inv, given the fp8 cache's V scales."""
    recorder = TypedRecorder()
    ops = Ops(recorder, None, num_sms=132)
    with pytest.raises(ValueError, match="exceed the invariant form's"):
        ops.attention_decode(1, 2, 3, 4, 5, 6, 7, 8, 9, 4, 0.125, 8, 2, 64, 16, 768, INVARIANT_PARTS + 1,
                             invariant=True)
    assert not ops.attention_decode(1, 2, 3, 4, 5, 6, 7, 8, 9, 4, 0.125, 8, 2, 64, 16, 768, 8, (10, 11),
                                    invariant=True, quantized=object())
    (decode, grid, _), (merge, merge_grid, block) = recorder.launches
    assert decode == "attention_decode_fp8_d64_r8_inv" and grid == (2, 4, 8)
    assert merge == "attention_combine_inv" and merge_grid == (8, 4) and block == (64, 1, 1)
    assert list(recorder.args[1]) == [1, 2, 3, 9, 8, 0, 11, 4]  # context_lens, parts, window, V scales, group


def test_an_expert_model_is_refused(forward_module):
    with pytest.raises(ValueError, match="batch_invariant on the cuda backend does not cover expert"):
        invariant_forward(forward_module, TypedRecorder(), architecture="Qwen3MoeForCausalLM", num_experts=4,
                          num_experts_per_tok=2, moe_intermediate_size=64)


def test_invariant_linear_needs_an_invariant_blas():
    with pytest.raises(ValueError, match="batch-invariant cuBLAS handle"):
        Linear(RecordingBlas(), Ops(TypedRecorder(), None, num_sms=132), invariant=True)
    linear = Linear(RecordingBlas(invariant=True), Ops(TypedRecorder(), None, num_sms=132), invariant=True)
    assert not linear.uses_gemv(1, 2048, 2048)


def test_block_scaled_fp8_weights_are_requantized_per_row(forward_module, tmp_path, caplog):
    """An FP8 checkpoint with 128 x 128 block scales: batch-invariant products run one pinned algorithm, which the
    block-scaled GEMM has not, so its weights are requantized with a scale per row (quantize_fp8), and a warning
    says so."""
    import logging

    pytest.importorskip("torch")
    from test_fp8_checkpoints import write_fp8_checkpoint
    from tinyvllm.backends.cuda.tensors import E4M3
    from tinyvllm.config import EngineConfig
    from tinyvllm.model.loader import load_model

    model = load_model(write_fp8_checkpoint(tmp_path, "fp8-block", head_dim=64)[0])
    engine = EngineConfig(block_size=16, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=128,
                          num_kv_blocks=8, batch_invariant=True)
    recorder = TypedRecorder()
    with caplog.at_level(logging.WARNING, logger="tinyvllm"):
        forward = forward_module.CudaForward(model, engine, FakeDevice(recorder), FakeStream(), 16)
    assert not forward.block_codes and "requantizes the block-scaled FP8 weights" in caplog.text
    layer = forward.layers[0]
    assert layer.qkv.dtype == E4M3 and layer.qkv.scale.shape == (layer.qkv.shape[0],)
    assert [name for name, _, _ in recorder.launches].count("quantize_fp8") == 4 * model.config.num_hidden_layers
