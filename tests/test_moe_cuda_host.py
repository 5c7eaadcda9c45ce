"""The cuda backend's MoE on the host, without a GPU: the padded grouping twin (align_block_size) against
group_by_expert, the tile bound the kernels' grids are sized by, the launchers' path choice and geometry, the
forward's launch sequence on a stand-in device (an FP8 checkpoint's, and quantization="fp8"'s e4m3 experts), the
presets. The kernels themselves: tests/gpu/test_moe_kernels.py."""

import importlib

import numpy as np
import pytest

from tinyvllm.backends.cuda.ops import (MOE_GEMM_BLOCK_MS, MOE_GEMV_TILE, SIGNATURES, Ops, moe_block_m,
                                        moe_max_tiles, moe_gemv_split, moe_uses_gemv)
from tinyvllm.backends.moe import align_block_size, group_by_expert, route
from tinyvllm.model.dummy import PRESETS
from tinyvllm.model.layout import weight_shapes

from test_cuda_ops import (FakeDevice, FakeGraph, Recorder, TypedRecorder, engine_config_for,  # noqa: F401
                           forward_module, graphs_module, serve_every_feature)


@pytest.mark.parametrize("tokens,experts,k,block_m", [(1, 128, 8, 8), (5, 8, 2, 64), (300, 16, 8, 64),
                                                      (3, 5, 4, 8)])
def test_align_block_size_is_group_by_expert_padded(tokens, experts, k, block_m):
    rng = np.random.default_rng(tokens)
    logits = rng.standard_normal((tokens, experts)).astype(np.float32)
    logits[:, 1] = -50  # nobody's
    _, ids = route(logits, k, True)
    order, offsets = group_by_expert(ids, experts)
    sorted_ids, expert_ids, total = align_block_size(ids, experts, block_m)
    assert total % block_m == 0 and len(expert_ids) == total // block_m and 1 not in expert_ids
    tiles = np.repeat(expert_ids, block_m)
    real = sorted_ids < ids.size
    np.testing.assert_array_equal(sorted_ids[real], order)  # the same order, the sentinels between the runs
    np.testing.assert_array_equal(ids.reshape(-1)[sorted_ids[real]], tiles[real])
    assert total <= moe_max_tiles(ids.size, experts, block_m) * block_m
    assert (np.bincount(expert_ids, minlength=experts) == -(-np.diff(offsets) // block_m)).all()


@pytest.mark.parametrize("assignments,experts,block_m", [(1, 128, 8), (64, 128, 8), (64, 8, 64), (2400, 128, 64),
                                                         (7, 3, 4)])
def test_moe_max_tiles_bounds_every_grouping(assignments, experts, block_m):
    """The worst grouping: as many experts as possible with one assignment, the rest on one expert."""
    ones = min(experts, assignments) - 1
    counts = [1] * ones + [assignments - ones]
    assert sum(-(-c // block_m) for c in counts) <= moe_max_tiles(assignments, experts, block_m)
    rng = np.random.default_rng(assignments)
    for _ in range(20):
        counts = np.bincount(rng.integers(0, experts, assignments), minlength=experts)
        assert (-(-counts // block_m)).sum() <= moe_max_tiles(assignments, experts, block_m)


def test_moe_launchers_pick_the_path_by_batch():
    """A few tokens: the GEMV kernels over tiles of 8 assignments; more: the grouped GEMM's, tiles of 32 while an
    expert averages at most 16 assignments, else 64."""
    recorder = Recorder()
    ops = Ops(recorder, None)
    assert moe_uses_gemv(8, 8, 128) and moe_uses_gemv(128, 8, 128) and not moe_uses_gemv(129, 8, 128)
    assert MOE_GEMM_BLOCK_MS == (32, 64)
    assert [moe_block_m(t, 8, 128) for t in (4, 128, 129, 256, 257, 4096)] == [MOE_GEMV_TILE] * 2 + [32] * 2 + [64] * 2
    # GEMV weight tiles: gate/up 96 of 8 units, 8 warps each over k 2048; down 128 of 16 columns, 4 warps over 768
    assert [moe_gemv_split(k) for k in (2048, 768, 512, 256, 264, 4096)] == [8, 4, 2, 1, 2, 8]
    ops.moe_topk_softmax(1, 2, 3, 4, 128, 8, True)
    ops.moe_align(1, 2, 3, 4, 32, 128, 8)
    ops.moe_gate_up(1, 2, 3, 4, 5, 6, 4, 8, 128, 2048, 768)
    ops.moe_down(1, 2, 3, 4, 5, 6, 7, 4, 8, 128, 2048, 768)
    ops.moe_gate_up(1, 2, 3, 4, 5, 6, 256, 8, 128, 2048, 768)
    ops.moe_down(1, 2, 3, 4, 5, 6, 7, 256, 8, 128, 2048, 768)
    ops.moe_gate_up(1, 2, 3, 4, 5, 6, 512, 8, 128, 2048, 768)
    ops.moe_down(1, 2, 3, 4, 5, 6, 7, 512, 8, 128, 2048, 768)
    ops.moe_sum(1, 2, 256, 8, 2048)
    assert recorder.launches == [
        ("moe_topk_softmax", (4,), (128, 1, 1)), ("moe_align", (128,), (256, 1, 1)),
        ("moe_gemv_gate_up", (32, 96), (256, 1, 1)), ("moe_gemv_down", (32, 64), (256, 1, 1)),
        # 2048 assignments in tiles of 32: at most 2048 / 32 + 128 * 31 / 32 = 188; 4096 in tiles of 64: 190
        ("moe_gemm_gate_up_32", (188, 12), (128, 1, 1)), ("moe_gemm_down_32", (188, 16), (128, 1, 1)),
        ("moe_gemm_gate_up_64", (190, 12), (256, 1, 1)), ("moe_gemm_down_64", (190, 16), (256, 1, 1)),
        ("moe_sum", (256, 2), (256, 1, 1))]


def test_moe_gemm_declares_its_pipeline_stages_as_dynamic_shared_memory():
    """Each grouped GEMM instance asks for MOE_GEMM_STAGES stages of its A (block_m rows) and B (128 rows) tiles of
    MOE_GEMM_BLOCK_K + 8 16-bit values, and the fp8 ones for each stage's e4m3 B codes too: what cuda/moe.cu's
    GemmStage array and codes are (the kernel traps on less); the rest of moe.cu none."""
    from tinyvllm.backends.cuda.ops import MOE_GEMM_BLOCK_K, MOE_GEMM_STAGES

    shared = {name: sig.shared_bytes for name, sig in SIGNATURES.items() if sig.shared_bytes and sig.file == "moe"}
    row = (MOE_GEMM_BLOCK_K + 8) * 2
    codes = 128 * MOE_GEMM_BLOCK_K  # the fp8 instances' e4m3 B codes of a stage, as they land
    assert shared == {f"moe_gemm_{fp8}{which}_{m}": MOE_GEMM_STAGES * ((m + 128) * row + (codes if fp8 else 0))
                      for which in ("gate_up", "down") for m in MOE_GEMM_BLOCK_MS for fp8 in ("", "fp8_")}
    assert max(shared.values()) <= 227 * 1024  # an H100/H200 block's most


@pytest.mark.parametrize("launch,message", [
    (lambda ops: ops.moe_topk_softmax(1, 2, 3, 4, 2048, 8, True), "at most 1024"),
    (lambda ops: ops.moe_topk_softmax(1, 2, 3, 4, 8, 9, True), "top_k 9 of 8"),
    (lambda ops: ops.moe_gate_up(1, 2, 3, 4, 5, 6, 4, 8, 128, 2048, 764), "inter 764 is not a multiple of 8"),
    (lambda ops: ops.moe_sum(1, 2, 4, 8, 2050), "hidden 2050")])
def test_moe_launchers_refuse_what_their_kernels_cannot_run(launch, message):
    with pytest.raises(ValueError, match=message):
        launch(Ops(Recorder(), None))


@pytest.mark.parametrize("architecture,extra", [
    ("Qwen3MoeForCausalLM", dict(mlp_only_layers=(1,), norm_topk_prob=True)),
    ("OlmoeForCausalLM", dict()), ("MixtralForCausalLM", dict())])
def test_moe_forward_launches_on_a_stand_in_device(forward_module, make_model_dir, monkeypatch, architecture, extra):
    """Through the engine on FakeDevice: expert layers launch the MoE sequence (prefill chunks of 32 tokens the
    grouped GEMM, decode the GEMV kernels), a dense layer the dense MLP, OLMoE its whole-projection q/k norms;
    the experts stacked [experts, rows, columns] on the device; every argument of its kernel's C type."""
    runner = importlib.import_module("tinyvllm.backends.cuda.runner")
    monkeypatch.setattr(graphs_module(), "Graph", FakeGraph)
    FakeGraph.made = []
    model = load_moe(make_model_dir, architecture, extra)
    device = FakeDevice(TypedRecorder())
    backend, names = serve_every_feature(runner, model, engine_config_for(model, "eager"), device, True)
    layers = backend.forward.layers
    assert layers[0].experts_gate_up.shape == (4, 2 * 32, 64) and layers[0].experts_down.shape == (4, 64, 32)
    assert layers[0].gate_up is None and (layers[1].router is None) == ("mlp_only_layers" in extra)
    expected = {"moe_topk_softmax", "moe_align", "moe_gemv_gate_up", "moe_gemv_down", "moe_sum"}
    assert expected <= set(names) <= set(device.prepared)
    gemm = [{f"moe_gemm_gate_up_{m}", f"moe_gemm_down_{m}"} for m in MOE_GEMM_BLOCK_MS]
    assert any(pair <= set(names) for pair in gemm)
    assert ("qk_norm_projection" in names) == (architecture == "OlmoeForCausalLM")
    assert ("gemv_swiglu_bf16" in names or "silu_and_mul" in names) == ("mlp_only_layers" in extra)
    backend.close()


def load_moe(make_model_dir, architecture, extra):
    from tinyvllm.model.loader import load_model

    path = make_model_dir(head_dim=64, architecture=architecture, num_experts=4, num_experts_per_tok=2,
                          moe_intermediate_size=32, **extra)
    return load_model(path)


def test_moe_kernels_are_built_only_for_moe_models():
    from tinyvllm.backends.cuda.kernels import needed_kernels

    moe = {name for name, s in SIGNATURES.items() if s.file == "moe"}
    assert not moe & set(needed_kernels(64, 8, 2, False)) and moe <= set(needed_kernels(64, 8, 2, False,
                                                                                         experts=True))


@pytest.mark.parametrize("preset,params,experts,top_k,renormalize", [("qwen3-30b-a3b", 30.5e9, 128, 8, True),
                                                                     ("mixtral-8x7b", 46.7e9, 8, 2, True),
                                                                     ("olmoe-1b-7b", 6.92e9, 64, 8, False)])
def test_moe_presets_have_the_real_shapes(preset, params, experts, top_k, renormalize):
    config = PRESETS[preset]()
    total = sum(int(np.prod(shape)) for shape in weight_shapes(config).values())
    assert abs(total - params) / params < 0.01
    assert (config.num_experts, config.num_experts_per_tok, config.norm_topk_prob) == (experts, top_k, renormalize)
    assert all(config.moe_layer(i) for i in range(config.num_hidden_layers))


def test_fp8_weights_on_a_moe_model_run_its_experts_in_e4m3_on_a_stand_in_device(forward_module, make_model_dir,
                                                                                  monkeypatch):
    """quantization="fp8" on a bf16 MoE model, through the engine on FakeDevice: each expert layer's stacked experts
    are quantized on the device (quantize_fp8 over every expert's rows: a scale per expert and output channel), the
    bf16 ones freed; a step quantizes the tokens' rows before the e4m3 gate/up product (up to 8 rows the norm before
    it has: its codes are the FP8 GEMV's) and the padded rows' activations before the down product
    (quantize_fp8_values), on the GEMV path (decode) and the grouped GEMM's (a prefill chunk of 32 tokens x 2 of 4
    experts). The kernels: tests/gpu/test_moe_kernels.py."""
    from tinyvllm.backends.cuda.tensors import E4M3, F32
    from tinyvllm.model.loader import load_model

    runner = importlib.import_module("tinyvllm.backends.cuda.runner")
    monkeypatch.setattr(graphs_module(), "Graph", FakeGraph)
    path = make_model_dir(head_dim=64, architecture="OlmoeForCausalLM", num_experts=4, num_experts_per_tok=2,
                          moe_intermediate_size=32)
    model = load_model(path)
    recorder = TypedRecorder()
    device = FakeDevice(recorder)
    backend, names = serve_every_feature(runner, model, engine_config_for(model, "eager", quantization="fp8"),
                                         device, True)
    cfg = model.config
    for layer in backend.forward.layers:
        for w, rows in ((layer.experts_gate_up, 2 * cfg.moe_intermediate_size), (layer.experts_down, cfg.hidden_size)):
            assert w.dtype == E4M3 and w.scale.dtype == F32 and w.scale.shape == (cfg.num_experts * rows,)
            assert w.ptr in device.live and w.scale.ptr in device.live
    load = recorder.launches[:names.index("embedding")]  # before the first step
    weights = [grid for name, grid, _ in load if name == "quantize_fp8"]  # a row a block
    experts = {cfg.num_experts * 2 * cfg.moe_intermediate_size, cfg.num_experts * cfg.hidden_size}
    dense = {w.shape[0] for layer in backend.forward.layers for w in (layer.qkv, layer.o)}
    assert {grid[0] for grid in weights} == experts | dense  # rows: every expert's at once
    assert {"moe_gemv_fp8_gate_up", "moe_gemv_fp8_down", "moe_gemm_fp8_gate_up_32", "moe_gemm_fp8_down_32"} <= \
        set(names)
    assert not {"moe_gemv_gate_up", "moe_gemm_gate_up_32", "moe_gemv_down"} & set(names)
    gate_up = [i for i, name in enumerate(names) if name.startswith("moe_") and "gate_up" in name]
    assert all(names[i + 1] == "quantize_fp8_values" for i in gate_up)  # the activations, for the down product
    # the tokens' rows: as the norm quantized them up to 8 rows (decode: the FP8 GEMV's codes), else quantized here
    before = {names[i - 1] for i in gate_up if names[i] == "moe_gemv_fp8_gate_up"}
    assert before == {"moe_align", "quantize_fp8_values"}
    assert all(names[i - 1] == "quantize_fp8_values" for i in gate_up if names[i] == "moe_gemm_fp8_gate_up_32")
    backend.close()


@pytest.mark.parametrize("scheme,extra", [("ct-channel", dict(head_dim=64)),
                                          ("fp8-block", dict(hidden_size=256, head_dim=64, intermediate_size=128,
                                                             moe_intermediate_size=128))])
def test_an_fp8_checkpoint_of_a_moe_model_runs_on_a_stand_in_device(forward_module, tmp_path, monkeypatch, caplog,
                                                                    scheme, extra):
    """An FP8 checkpoint of Qwen3-MoE through the engine on FakeDevice: the attention's and the dense layer's
    linear weights run FP8 W8A8 (e4m3, a scale per row); the experts too where their scales are per channel (the
    bytes sent for an expert's weight its stored codes, its scales one per expert and row), while block-scaled ones
    run bf16 (the bytes sent its codes times their scales rounded to bf16), and a warning says so. The values of
    the scales as uploaded: tests/gpu/test_moe_models.py (cuda against numpy on the same file)."""
    import logging

    from tinyvllm.backends.cuda.tensors import BF16, E4M3
    from tinyvllm.model.dtypes import f32_to_bf16
    from tinyvllm.model.loader import load_model

    pytest.importorskip("torch")  # write_fp8_checkpoint's
    from test_family_moe import CONFIGS
    from test_fp8_checkpoints import write_fp8_checkpoint

    path, cfg, reference, *_ = write_fp8_checkpoint(tmp_path, scheme, **{**CONFIGS["qwen3_moe"], **extra})
    runner = importlib.import_module("tinyvllm.backends.cuda.runner")
    monkeypatch.setattr(graphs_module(), "Graph", FakeGraph)
    sent = {}
    monkeypatch.setattr(forward_module.cuda, "memcpy_htod_async",
                        lambda address, array, stream: sent.setdefault(address, array.tobytes()))
    model = load_model(path)
    with caplog.at_level(logging.WARNING, logger="tinyvllm"):
        backend, names = serve_every_feature(runner, model, engine_config_for(model, "eager"),
                                             FakeDevice(TypedRecorder()), True)
    block = scheme == "fp8-block"
    assert (f"the experts of {path} run as bf16 weights" in caplog.text) == block
    layers = backend.forward.layers
    assert all(layer.qkv.dtype == layer.o.dtype == E4M3 for layer in layers)
    ignored = scheme == "ct-channel"  # its checkpoint leaves model.layers.1.mlp.down_proj unquantized
    assert (layers[1].gate_up.dtype, layers[1].down.dtype) == (E4M3, BF16 if ignored else E4M3)  # dense layer 1
    experts = BF16 if block else E4M3
    assert all(layer.experts_gate_up.dtype == layer.experts_down.dtype == experts for layer in (layers[0], layers[2]))
    checkpoint = model.weights
    for field, part in (("experts_gate_up", "gate_proj"), ("experts_down", "down_proj")):  # expert 0's first part
        name = f"model.layers.2.mlp.experts.0.{part}.weight"
        want = f32_to_bf16(reference[name]) if block else checkpoint.tensors.stored(name)
        assert sent[getattr(layers[2], field).ptr] == want.tobytes()
        if not block:  # a scale per expert and row
            w = getattr(layers[2], field)
            assert w.scale.shape == (w.numel // w.shape[-1],)
    gemv = "gemv_fp8_block_bf16" if block else "gemv_fp8_bf16"  # block scales: run as stored
    assert {gemv, "moe_gemv_gate_up" if block else "moe_gemv_fp8_gate_up", "moe_topk_softmax"} <= set(names)
    # a prefill chunk's dense MLP: the activation quantized for an e4m3 down projection, in bf16 for a bf16 one (and
    # for block scales, whose products quantize their inputs per 128 columns: quantize_fp8_groups)
    bf16_act = ignored or scheme == "fp8-block"
    assert ("silu_and_mul_e4m3" in names, "silu_and_mul" in names) == (not bf16_act, bf16_act)
    assert ("quantize_fp8_groups" in names) == (scheme == "fp8-block")
    backend.close()


def test_backend_auto_takes_the_gpu_for_fp8_weights_on_a_moe_model(forward_module, make_model_dir, monkeypatch):
    """Where a usable GPU is there, backend auto builds the cuda backend for quantization="fp8" on a MoE model (its
    experts run W8A8 there), as for any other model: no fallback to the CPU."""
    import tinyvllm.backends as backends
    from tinyvllm.config import EngineConfig
    from tinyvllm.model.loader import load_model

    runner = importlib.import_module("tinyvllm.backends.cuda.runner")
    built = []

    class Built(Exception):
        pass

    def cuda_backend(model, config, use_graphs=True):
        built.append(config.quantization)
        raise Built

    monkeypatch.setattr(runner, "CudaBackend", cuda_backend)
    monkeypatch.setattr(backends, "cuda_unavailable_reason", lambda: None)
    model = load_model(make_model_dir(head_dim=64, architecture="OlmoeForCausalLM", num_experts=4,
                                      num_experts_per_tok=2, moe_intermediate_size=32))
    config = EngineConfig(backend="auto", quantization="fp8").for_model(model.config.max_position_embeddings)
    with pytest.raises(Built):
        backends.create_backend(model, config)
    assert built == ["fp8"]


def test_e4m3_experts_refuse_widths_their_loads_cannot_take(forward_module, make_model_dir, monkeypatch):
    """quantization="fp8" on experts 40 wide (whole 16-byte loads of bf16, not of e4m3 codes): refused in one line
    when the backend is built, before any weight is uploaded; without it the same model runs (bf16 experts)."""
    from tinyvllm.model.loader import load_model

    runner = importlib.import_module("tinyvllm.backends.cuda.runner")
    monkeypatch.setattr(graphs_module(), "Graph", FakeGraph)
    model = load_model(make_model_dir(head_dim=64, architecture="OlmoeForCausalLM", num_experts=4,
                                      num_experts_per_tok=2, moe_intermediate_size=40))
    device = FakeDevice(TypedRecorder())
    with pytest.raises(ValueError, match="^the cuda backend's e4m3 experts need hidden_size and "
                                         "moe_intermediate_size divisible by 16 .* not 64 and 40: run without "
                                         "quantization, or on the numpy backend$"):
        runner.CudaBackend(model, engine_config_for(model, "eager", quantization="fp8"), device=device)
    assert not device.kernels.launches
    backend, names = serve_every_feature(runner, model, engine_config_for(model, "eager"), FakeDevice(TypedRecorder()),
                                         True)
    assert "moe_gemv_gate_up" in names
    backend.close()


def test_an_fp8_checkpoint_with_unquantized_experts_runs_them_as_bf16_without_a_warning(forward_module, tmp_path,
                                                                                         monkeypatch, caplog):
    """A Qwen3-MoE FP8 checkpoint whose experts are in its ignore list: its dense layers run W8A8, its experts are
    the bf16 weights they are stored as (nothing dequantized, so no warning), the MoE buffers without fp8 codes."""
    import logging

    from tinyvllm.backends.cuda.tensors import BF16, E4M3
    from tinyvllm.model.loader import load_model

    pytest.importorskip("torch")  # write_fp8_checkpoint's
    import test_fp8_checkpoints
    from test_family_moe import CONFIGS

    cfg = CONFIGS["qwen3_moe"]
    experts = [f"model.layers.{i}.mlp.experts.{e}.{p}_proj" for i in range(cfg["num_hidden_layers"])
               for e in range(cfg["num_experts"]) for p in ("gate", "up", "down")]
    quant, *rest = test_fp8_checkpoints.SCHEMES["ct-channel"]
    monkeypatch.setitem(test_fp8_checkpoints.SCHEMES, "dense", ({**quant, "ignore": ["lm_head", *experts]}, *rest))
    path, *_ = test_fp8_checkpoints.write_fp8_checkpoint(tmp_path, "dense", **{**cfg, "head_dim": 64})
    runner = importlib.import_module("tinyvllm.backends.cuda.runner")
    monkeypatch.setattr(graphs_module(), "Graph", FakeGraph)
    model = load_model(path)
    with caplog.at_level(logging.WARNING, logger="tinyvllm"):
        backend, names = serve_every_feature(runner, model, engine_config_for(model, "eager"),
                                             FakeDevice(TypedRecorder()), True)
    assert "run as bf16 weights" not in caplog.text
    forward = backend.forward
    assert all(layer.qkv.dtype == E4M3 for layer in forward.layers) and not forward.fp8_experts
    assert all(layer.experts_gate_up.dtype == layer.experts_down.dtype == BF16 for layer in forward.layers
               if layer.experts_gate_up is not None)
    assert forward.moe_buf.x_codes is None and "moe_gemv_gate_up" in names
    backend.close()


@pytest.mark.parametrize("preset,active_gb,total_gb", [("qwen3-30b-a3b", 6.08, 61.06), ("mixtral-8x7b", 25.5, 93.4),
                                                        ("olmoe-1b-7b", 2.36, 13.84)])
def test_moe_presets_floors(preset, active_gb, total_gb):
    """A decode step reads the shared weights and the experts its tokens chose: one token's top_k (the active
    weights: Qwen3-30B-A3B ~3 B parameters, Mixtral-8x7B ~12.9 B), a large batch's nearly every expert (the whole
    model but the embedding table it gathers rows of). The FLOPs per token are the active parameters'."""
    from tinyvllm.benchmark import experts_read, expert_params, make_workload, matmul_params, weight_bytes, \
        workload_floor

    config = PRESETS[preset]()
    shapes = weight_shapes(config)
    params = sum(int(np.prod(shape)) for shape in shapes.values())
    embed = config.vocab_size * config.hidden_size
    e, k, layers = config.num_experts, config.num_experts_per_tok, config.num_hidden_layers
    experts = sum(int(np.prod(shape)) for name, shape in shapes.items() if ".experts." in name)
    assert experts == layers * e * expert_params(config)
    assert weight_bytes(config, 10_000) == 2 * (params - embed)  # every expert
    assert weight_bytes(config) == 2 * (params - embed - layers * (e - k) * expert_params(config))
    assert abs(weight_bytes(config) / 1e9 - active_gb) < 0.05 and abs(2 * params / 1e9 - total_gb) < 0.1
    assert experts_read(config, 1) == k and experts_read(config, 2) == pytest.approx(e - e * (1 - k / e) ** 2)
    linear = sum(int(np.prod(shape)) for name, shape in shapes.items()
                 if len(shape) == 2 and "embed" not in name and ".experts." not in name)
    assert matmul_params(config) == linear + layers * k * expert_params(config)
    # batch-1 decode at 4.27 TB/s: the active weights per token, not the whole model's
    w3 = workload_floor(config, make_workload("W3", config.vocab_size), 4.27e12, 7.4e14, 512)
    assert w3.decode_weights_s / 255 == pytest.approx(weight_bytes(config) / 4.27e12)
    assert weight_bytes(config, 4) < weight_bytes(config, 64) <= weight_bytes(config, 10_000)
