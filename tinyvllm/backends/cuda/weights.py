"""The model's weights onto the GPU, for CudaForward (forward.py): every packed tensor placed and written layer by
layer, from the model file through pinned staging buffers or made on the device (dummy weights); each layer's gate/up
rows interleaved for the GEMV's SwiGLU epilogue; an FP8 checkpoint's codes as stored, with their scales; with FP8
weights the rest quantized to e4m3 as each layer arrives, so the GPU never holds more than one layer's bf16 form of
them. What runs in e4m3 is decided here too (fp8, block_codes, fp8_experts), before anything is uploaded."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
from collections.abc import Callable, Mapping

import numpy as np
import pycuda.driver as cuda

from tinyvllm.backends.cuda.cublas import SCALE_BLOCK, WORKSPACE_BYTES, block_scale_stride
from tinyvllm.backends.cuda.device import Device
from tinyvllm.backends.cuda.ops import Ops
from tinyvllm.backends.cuda.tensors import BF16, E4M3, F32, U8, DeviceLayer, DeviceTensor, nbytes
from tinyvllm.config import EngineConfig
from tinyvllm.model.dummy import RandomBf16Weights
from tinyvllm.model.fp8_checkpoint import Fp8CheckpointWeights
from tinyvllm.model.layout import model_parts, stacked_experts
from tinyvllm.model.loader import Bf16Bytes, StoredBytes, stream_bf16, weight_shapes
from tinyvllm.model.weights import layer_parts

log = logging.getLogger(__name__)

GIB = 1 << 30
# Pinned host buffers the weights pass through: two suffice to overlap reading one with copying the other (the
# copy is the faster), a third absorbs jitter; pieces of 32 MiB make the per-piece costs negligible.
STAGING_BUFFERS, STAGING_BYTES = 3, 32 << 20
FP8_MATRICES = ("qkv", "o", "gate_up", "down")  # the layer weights FP8 W8A8 quantizes (the LM head: quantize_lm_head)
FP8_EXPERTS = ("experts_gate_up", "experts_down")  # and an expert layer's where they run FP8 (_runs_fp8_experts)


def fp8_weights(model, engine_config: EngineConfig) -> bool:
    """Whether the layers' linear weights run FP8 W8A8: quantization="fp8", or an FP8 checkpoint (its codes as
    stored, its scales per tensor, channel or 128 x 128 block; or requantized per output channel:
    WeightUploader._stored_codes)."""
    return engine_config.quantization == "fp8" or model.config.quantization is not None


class WeightUploader:
    """One model's weights onto one device, on `stream`: after upload(), embed, lm_head, final_norm and layers are
    its device tensors; fp8 (the linear layers run W8A8), block_codes (an FP8 checkpoint's 128 x 128 block-scaled
    codes run as stored) and fp8_experts (expert layers run e4m3 experts) say what runs in e4m3."""

    def __init__(self, model, engine_config: EngineConfig, device: Device, stream: cuda.Stream) -> None:
        self.config = model.config
        # HF name -> shape, and each layer's packed tensors' parts (a MoE model's: tens of ms to list, so listed once)
        self.shapes = weight_shapes(model.config)
        self.parts = [layer_parts(model.config, i) for i in range(model.config.num_hidden_layers)]
        self.device, self.stream = device, stream
        self.device_name = device.name
        self.invariant = engine_config.batch_invariant
        self.fp8 = fp8_weights(model, engine_config)
        self.block_codes = self._runs_block_scales(model.weights)
        self.fp8_experts = self._runs_fp8_experts(model.weights, engine_config)
        self.embed: DeviceTensor | None = None
        self.lm_head: DeviceTensor | None = None
        self.final_norm: DeviceTensor | None = None
        self.layers: list[DeviceLayer] = []

    @property
    def ops(self) -> Ops:
        """The launchers, asked for at the first kernel the upload launches: Device.ops waits for the model's kernels
        to be built, which goes on beside the upload of weights that need none (bf16, FP8 codes as stored)."""
        return self.device.ops(self.stream)

    def upload(self, w: Mapping[str, np.ndarray]) -> None:
        """Every weight to the GPU, once, packed as model/weights.py packs them: a packed tensor is its parts' rows
        one after another in device memory, so the parts are copied to their offsets and never fused on the host.
        Each part goes from the model file (a bf16 checkpoint's as stored, with no host copy of the tensor) through a
        few pinned staging buffers, whose asynchronous copies overlap the reading of the next pieces. In bf16, but
        the e4m3 codes that an FP8 checkpoint stores with a scale per tensor or channel (_stored_codes). Layer by
        layer (_upload_layer): the weights FP8 quantizes at load (_quantized_fields) become e4m3 before the next
        layer's arrive, so the GPU holds one layer's of them in bf16 at a time and an FP8 model loads where its
        bf16 form would not fit."""
        cfg, shapes, names = self.config, self.shapes, model_parts(self.config)
        stored = [self._stored_codes(w, i) for i in range(cfg.num_hidden_layers)]
        quantized = [self._quantized_fields(w, i, stored[i]) for i in range(cfg.num_hidden_layers)]
        coded = {name for i, fields in enumerate(stored) for field in fields for name in self.parts[i][field]}
        self._check_weights_fit(shapes, stored, quantized)
        with self._part_writer(w, coded) as write:
            parts: list[tuple[int, str]] = []  # (device address, HF name) of every part, in upload order
            self.embed = self._place(names["embed"], BF16, parts)
            self.lm_head = self.embed if cfg.tie_word_embeddings else self._place(names["lm_head"], BF16, parts)
            self.final_norm = self._place(names["final_norm"], BF16, parts)
            write(parts)
            self.layers = [self._upload_layer(w, i, stored[i], quantized[i], write)
                           for i in range(cfg.num_hidden_layers)]
        if self.fp8:
            log.info("cuda weights: linear layers in fp8 (e4m3, a scale per %s)",
                     "128 x 128 block, as stored" if self.block_codes else "output channel")
        if self._dequantized_experts(w):
            log.warning("cuda weights: the experts of %s run as bf16 weights (each e4m3 code times its scale, rounded "
                        "to bf16; their inputs unquantized): the cuda MoE kernels take e4m3 experts with a scale per "
                        "expert and row, and requantizing block-scaled codes would change them. The other linear "
                        "layers run FP8 W8A8; backend numpy runs the experts FP8 W8A8 too", w.source)
        log.info("cuda weights: %.2f GiB on %s", self._weights_bytes(shapes, stored, quantized) / GIB,
                 self.device_name)

    def _upload_layer(self, w: Mapping[str, np.ndarray], i: int, stored: list[str], quantized: list[str],
                      write: Callable[[list[tuple[int, str]]], None]) -> DeviceLayer:
        """Layer i on the GPU: its packed tensors placed and written (`write` returns once they are there), its
        gate/up rows interleaved, its stored codes' scales attached, the fields in `quantized` made e4m3."""
        cfg, parts = self.config, []
        stacked = stacked_experts(cfg)  # [num_experts, rows, columns]: each expert's parts' rows, expert by expert

        def packed(field: str, tensors: list[str]) -> DeviceTensor:
            t = self._place(tensors, E4M3 if field in stored else BF16, parts)
            return DeviceTensor(t.ptr, t.dtype, (cfg.num_experts, t.shape[0] // cfg.num_experts, *t.shape[1:])) \
                if field in stacked else t

        layer = DeviceLayer(**{field: packed(field, tensors) for field, tensors in self.parts[i].items()})
        write(parts)
        if layer.gate_up is not None and not (self.block_codes and "gate_up" in stored):
            self._interleave_gate_up(layer.gate_up)
        layer = self._attach_scales(w, i, layer, stored)
        return self._quantize_layer(layer, quantized)

    def _place(self, names: list[str], dtype: str, parts: list[tuple[int, str]]) -> DeviceTensor:
        """Device memory for one packed tensor (its parts' rows stacked); the named parts' addresses go to `parts`."""
        part_shapes = [self.shapes[name] for name in names]
        tensor = self.device.empty(dtype, (sum(shape[0] for shape in part_shapes), *part_shapes[0][1:]))
        sizes = [nbytes(dtype, shape) for shape in part_shapes]
        parts.extend(zip(itertools.accumulate(sizes[:-1], initial=tensor.ptr), names))
        return tensor

    def _quantized_fields(self, w: Mapping[str, np.ndarray], i: int, stored: list[str]) -> list[str]:
        """Layer i's weights that go up in bf16 and become e4m3 codes with a scale per row at load: with FP8
        weights, its linear layers' (_fp8_fields; with fp8_experts its stacked experts too) but the codes a
        checkpoint stores (_stored_codes)."""
        if not self.fp8:
            return []
        experts = FP8_EXPERTS if self.fp8_experts and not isinstance(w, Fp8CheckpointWeights) else ()
        parts = self.parts[i]
        return [field for field in (*self._fp8_fields(w, i), *experts) if field in parts and field not in stored]

    def _weights_bytes(self, shapes: dict[str, tuple[int, ...]], stored: list[list[str]],
                       quantized: list[list[str]]) -> int:
        """The weights' device bytes once loaded: e4m3 codes for the stored and quantized fields (their scales
        aside), bf16 for the rest; a tied LM head is the embedding."""
        cfg, names = self.config, model_parts(self.config)
        coded = {name for i in range(cfg.num_hidden_layers) for field in stored[i] + quantized[i]
                 for name in self.parts[i][field]}
        return sum(nbytes(E4M3 if name in coded else BF16, shape) for name, shape in shapes.items()
                   if not (cfg.tie_word_embeddings and name in names["lm_head"]))

    def _check_weights_fit(self, shapes: dict[str, tuple[int, ...]], stored: list[list[str]],
                           quantized: list[list[str]]) -> None:
        """MemoryError in one line unless the loaded weights and, while a layer loads, its bf16 weights that become
        e4m3 and the scratch of its gate/up interleave fit in the free device memory; for bf16 weights that do not,
        what quantization="fp8" would need where that fits."""
        size, transient = self._load_bytes(shapes, stored, quantized)
        free, total = self.device.mem_get_info()
        if size + transient <= free:
            return
        hint = ""
        if not self.fp8:  # each layer's linear layers and experts in e4m3, as quantization="fp8" has them
            cfg = self.config
            fp8 = [[field for field in (*FP8_MATRICES, *FP8_EXPERTS) if field in self.parts[i]]
                   for i in range(cfg.num_hidden_layers)]
            fp8_size, fp8_transient = self._load_bytes(shapes, stored, fp8)
            if fp8_size + fp8_transient <= free:
                hint = f"; in FP8 (quantization=\"fp8\", --quantization fp8) they would need {fp8_size / GIB:.2f} GiB"
        raise MemoryError(f"the model's weights need {size / GIB:.2f} GiB (and {transient / GIB:.2f} more while a "
                          f"layer loads) but the GPU ({self.device_name}) has {free / GIB:.2f} of {total / GIB:.2f} "
                          f"GiB free{hint}")

    def _load_bytes(self, shapes: dict[str, tuple[int, ...]], stored: list[list[str]],
                    quantized: list[list[str]]) -> tuple[int, int]:
        """(the loaded weights' device bytes, the most a layer holds beside them while it loads: its bf16 weights
        that become e4m3 and the scratch of its gate/up interleave)."""
        cfg, transient = self.config, 0
        for i in range(cfg.num_hidden_layers):
            parts = self.parts[i]
            layer = sum(nbytes(BF16, shapes[name]) for field in quantized[i] for name in parts[field])
            if "gate_up" in parts:
                layer += sum(nbytes(BF16, shapes[name]) for name in parts["gate_up"])
            transient = max(transient, layer)
        return self._weights_bytes(shapes, stored, quantized), transient

    def _runs_block_scales(self, w: Mapping[str, np.ndarray]) -> bool:
        """Whether an FP8 checkpoint with 128 x 128 block scales runs its codes as stored (the products scaled per
        block: Linear._gemm_fp8_blocks): where cuBLASLt has block-scaled algorithms for every layer's shapes, each
        of whole 128-column blocks (the only ones measured: bench/results/2026-12-07-h100-fp8-block-scales.txt), and
        not in batch-invariant mode (its products run one pinned algorithm, and the block-scaled GEMM has no split-
        free one to pin). Otherwise those weights go in bf16 and are requantized per row (_quantize_layer)."""
        if not isinstance(w, Fp8CheckpointWeights) or w.scheme.block != (SCALE_BLOCK, SCALE_BLOCK):
            return False
        if self.invariant:
            log.warning("cuda weights: batch_invariant requantizes the block-scaled FP8 weights with a scale per row")
            return False
        # a handle only asked, never run: the workspace's size (the heuristics' limit) without its memory
        probe = self.device.cublas(self.stream, DeviceTensor(0, U8, (WORKSPACE_BYTES,)))
        shapes = self.shapes
        try:
            for i in range(self.config.num_hidden_layers):
                parts = self.parts[i]
                for field in self._fp8_fields(w, i):
                    n, k = sum(shapes[name][0] for name in parts[field]), shapes[parts[field][0]][1]
                    if k % SCALE_BLOCK or not probe.scales_blocks(n, k):
                        log.warning("cuda weights: no block-scaled FP8 product for [%d, %d] (cuBLASLt's, for whole "
                                    "128-column blocks): the block-scaled weights are requantized with a scale per "
                                    "row", n, k)
                        return False
        finally:
            self.device.release(probe)
        return True

    def _stored_codes(self, w: Mapping[str, np.ndarray], i: int) -> list[str]:
        """Layer i's linear weights that go to the GPU as the e4m3 codes the checkpoint stores: an FP8 checkpoint's
        with a scale per tensor or per output channel (one per row, as the FP8 kernels take them), or per 128 x 128
        block where those run (_runs_block_scales), so its codes run unchanged; its experts too where their scales
        are per tensor or channel (_stored_experts). Other block scales have no such form: those dense weights go in
        bf16 and are requantized per row (_quantize_layer), those experts run as bf16 weights."""
        if not isinstance(w, Fp8CheckpointWeights) or (w.scheme.block is not None and not self.block_codes):
            return []
        return self._fp8_fields(w, i) + self._stored_experts(w, i)

    def _stored_experts(self, w: Fp8CheckpointWeights, i: int) -> list[str]:
        """Layer i's stacked experts (FP8_EXPERTS) as an FP8 checkpoint stores them, where every expert's gate, up
        and down are float8 with a scale per tensor or channel (a scale per expert and row, as the expert kernels
        take them); else none."""
        parts = self.parts[i]
        stored = w.scheme.block is None and all(field in parts and all(name in w.scales for name in parts[field])
                                                for field in FP8_EXPERTS)
        return list(FP8_EXPERTS) if stored else []

    def _runs_fp8_experts(self, w: Mapping[str, np.ndarray], engine_config: EngineConfig) -> bool:
        """Whether expert layers run their experts FP8 W8A8: quantization="fp8" on a bf16 checkpoint (quantized at
        load), or an FP8 checkpoint's experts as stored (_stored_experts). Block-scaled experts run as bf16 weights
        (_upload_weights warns)."""
        cfg = self.config
        if not cfg.num_experts:
            return False
        if not isinstance(w, Fp8CheckpointWeights):
            return engine_config.quantization == "fp8"
        return any(self._stored_experts(w, i) for i in range(cfg.num_hidden_layers))

    def _attach_scales(self, w: Mapping[str, np.ndarray], i: int, layer: DeviceLayer,
                       stored: list[str]) -> DeviceLayer:
        """Layer i with each stored-codes weight's float32 scales uploaded and attached: one a row (its parts' scales
        stacked; gate/up's in the interleaved order of its rows, _interleave_gate_up), or one a 128 x 128 block
        (_block_scales)."""
        parts, scales = self.parts[i], {}
        for field in stored:
            tensor = getattr(layer, field)
            if self.block_codes:
                values = self._block_scales(w, parts[field], tensor.shape[1])
            else:
                values = np.concatenate([w.row_scales(name) for name in parts[field]])
                if field == "gate_up":  # gate rows, then up rows -> groups of 8 gate rows, each before 8 up rows
                    values = values.reshape(2, -1, 8).transpose(1, 0, 2).reshape(-1)
            scales[field] = dataclasses.replace(tensor, scale=self.device.upload(values, F32))
        return dataclasses.replace(layer, **scales)

    @staticmethod
    def _block_scales(w: Fp8CheckpointWeights, names: list[str], k: int) -> np.ndarray:
        """A packed weight's block scales [ceil(rows / 128), block_scale_stride(k)] (its parts' stacked; rows
        padded as cuBLASLt reads them): each part must be whole blocks of rows, or the packed tensor's blocks would
        mix parts (the numpy backend refuses those checkpoints too: model/fp8.py stack_rows)."""
        for name in names:
            if w.shape(name)[0] % SCALE_BLOCK:
                raise ValueError(f"{w.source}: {name} has {w.shape(name)[0]} rows: a fused projection's parts must "
                                 f"have a multiple of the weight block's {SCALE_BLOCK} rows")
        scales = np.concatenate([w.block_scales(name) for name in names])
        padded = np.zeros((len(scales), block_scale_stride(k)), np.float32)
        padded[:, :scales.shape[1]] = scales
        return padded

    @contextlib.contextmanager
    def _part_writer(self, w: Mapping[str, np.ndarray], coded: set[str]):
        """A function that writes (device address, HF name) parts to their addresses and returns once they are
        there (_random_parts, _stream_parts), with what it needs kept from one call to the next and freed after."""
        if isinstance(w, RandomBf16Weights):
            tables: dict[int, DeviceTensor] = {}
            try:
                yield lambda parts: self._random_parts(w, parts, tables)
            finally:
                for table in tables.values():
                    self.device.free(table)
            return
        staging = [self.device.pinned(STAGING_BYTES, np.uint8) for _ in range(STAGING_BUFFERS)]
        sent = [cuda.Event() for _ in staging]  # one not yet recorded counts as done
        try:
            yield lambda parts: self._stream_parts(w, parts, coded, staging, sent)
        finally:
            self.stream.synchronize()  # before the staging buffers are freed, also when a read failed
            for buffer in staging:
                self.device.free_pinned(buffer)

    def _random_parts(self, w: RandomBf16Weights, parts: list[tuple[int, str]], tables: dict[int, DeviceTensor]):
        """Dummy weights made where they go (ops.random_bf16, the same bits as w.stored): a 61 GB model in well
        under a second, nothing made or copied on the host but the value tables (one per (mean, std), in
        `tables`)."""
        for address, name in parts:
            recipe = w.recipe(name)
            if id(recipe.table) not in tables:
                tables[id(recipe.table)] = self.device.upload(recipe.table, BF16)
            self.ops.random_bf16(address, tables[id(recipe.table)].ptr, recipe.size, recipe.k1, recipe.k2)
        self.stream.synchronize()

    def _stream_parts(self, w: Mapping[str, np.ndarray], parts: list[tuple[int, str]], coded: set[str],
                      staging: list[np.ndarray], sent: list[cuda.Event]) -> None:
        """Each (device address, HF name) part's bf16 bytes (those in `coded`: its stored e4m3 codes) to its address,
        through the pinned staging buffers (`sent[i]` recorded after buffer i's last copy)."""

        def send(i: int, size: int, address: int) -> None:
            cuda.memcpy_htod_async(address, staging[i][:size], self.stream)
            sent[i].record(self.stream)

        # a generator: each part is opened (or converted) only when its turn comes
        stream_bf16(((address, StoredBytes(w.tensors.stored(name)) if name in coded else Bf16Bytes(w, name))
                     for address, name in parts), staging, lambda i: sent[i].synchronize(), send)
        self.stream.synchronize()

    def _interleave_gate_up(self, w: DeviceTensor) -> None:
        """A gate/up weight [2 * inter, hidden] from its parts' order (the gate rows, then the up rows) to groups of
        8 gate rows each followed by the same units' 8 up rows: then a 16-row tile of the GEMV holds both halves of 8
        units and its epilogue applies SwiGLU (gemv.cu), and cuBLAS's output columns come in the order that
        silu_and_mul reads (activation.cu). On the GPU, through a scratch copy. (An expert layer's stacked experts
        keep their order: cuda/moe.cu reads each expert's gate and up rows where they are; so do block-scaled FP8
        codes, whose 128-row blocks each have their own scales: linear.py runs them without the GEMV's epilogue.)"""
        scratch = self.device.empty(BF16, w.shape)
        try:
            group = 8 * w.row_bytes  # bytes of 8 rows
            cuda.memcpy_dtod(scratch.ptr, w.ptr, w.nbytes)
            for half in range(2):  # gate, then up: into every other group
                copy = cuda.Memcpy2D()
                copy.set_src_device(scratch.ptr + half * (w.nbytes // 2))
                copy.set_dst_device(w.ptr + half * group)
                copy.src_pitch, copy.dst_pitch = group, 2 * group
                copy.width_in_bytes, copy.height = group, w.shape[0] // 2 // 8
                copy(aligned=True)
            cuda.Context.synchronize()
        finally:
            self.device.free(scratch)

    def _fp8_fields(self, weights: Mapping[str, np.ndarray], i: int) -> list[str]:
        """Layer i's linear weights that run in e4m3: every one of FP8_MATRICES, but of an FP8 checkpoint only those
        it stores in float8 (a layer it left unquantized stays bf16, as on the numpy backend)."""
        if not isinstance(weights, Fp8CheckpointWeights):
            return list(FP8_MATRICES)
        parts = self.parts[i]  # an expert layer has no gate_up or down (its experts: _stored_experts)
        return [field for field in FP8_MATRICES if field in parts and all(name in weights.scales
                                                                           for name in parts[field])]

    def _quantize_layer(self, layer: DeviceLayer, fields: list[str]) -> DeviceLayer:
        """The layer with each of `fields` from bf16 to e4m3 codes with a float32 scale per output channel (row),
        amax(row) / 448, on the GPU (quantize_fp8), its bf16 weight freed once the codes are made: the rows of
        gate_up are quantized in their interleaved order, which per-row scales do not mind; an expert layer's rows
        expert after expert (a scale per expert and channel)."""
        quantized = {}
        for field in fields:
            w = getattr(layer, field)
            rows = w.numel // w.shape[-1]
            scale = self.device.empty(F32, (rows,))
            codes = self.device.empty(E4M3, w.shape)
            self.ops.quantize_fp8(codes.ptr, scale.ptr, w.ptr, rows, w.shape[-1])
            quantized[field] = DeviceTensor(codes.ptr, E4M3, w.shape, scale)
        self.stream.synchronize()
        for field in quantized:
            self.device.free(getattr(layer, field))
        return dataclasses.replace(layer, **quantized)

    def _dequantized_experts(self, weights: Mapping[str, np.ndarray]) -> bool:
        """Whether an FP8 checkpoint's float8 experts run as bf16 weights (block-scaled: _stored_experts); experts
        it leaves unquantized are bf16 weights anyway."""
        if self.fp8_experts or not isinstance(weights, Fp8CheckpointWeights):
            return False
        return any(name in weights.scales for i in range(self.config.num_hidden_layers)
                   for field, names in self.parts[i].items() if field in FP8_EXPERTS for name in names)

    def quantize_lm_head(self) -> None:
        """The LM head in e4m3 with a scale per vocabulary row, as the layers' weights: a tied one gets codes of its
        own (the bf16 embedding stays, for the lookup), an untied one's bf16 rows are freed."""
        w = self.lm_head
        scale, codes = self.device.empty(F32, w.shape[:1]), self.device.empty(E4M3, w.shape)
        self.ops.quantize_fp8(codes.ptr, scale.ptr, w.ptr, w.shape[0], w.shape[1])
        self.stream.synchronize()
        if w is not self.embed:
            self.device.free(w)
        self.lm_head = DeviceTensor(codes.ptr, E4M3, w.shape, scale)
        log.info("cuda weights: LM head quantized to fp8 (e4m3, a scale per vocabulary row)")
