"""CudaBackend: the Llama forward in bf16 on one NVIDIA GPU, over a paged KV cache in device memory.

Per layer: rms_norm -> QKV GEMM -> rope -> reshape_and_cache -> attention -> O GEMM (+= residual) -> rms_norm ->
gate/up GEMM -> silu_and_mul -> down GEMM (+= residual). Linear layers are cuBLAS GEMMs, or our GEMV kernel for up
to 8 rows (linear.py), bf16 in and float32 compute; the residual stream stays float32 and the O and down GEMMs add
into it (beta = 1). The LM head writes float32 logits that never leave the GPU: the sampler kernel returns token
ids (and logprobs when asked).

Prefill runs eagerly, in chunks of at most max(max_num_batched_tokens, max_num_seqs) tokens (a longer prompt is
computed chunk by chunk: its earlier chunks' K/V are already in the cache). Decode steps are CUDA graphs, one per
batch-size bucket, all captured when the KV cache is made; each step copies its inputs into fixed device buffers with
one host-to-device copy and replays the graph.

submit() only queues a step: the engine prepares step N+1 while the GPU runs step N. A decode that continues a
sequence whose last token step N is still sampling reads that token on the GPU (resolve_tokens), and step N's
outputs come back through one of two host copies, so they stay readable after step N+1 is queued.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

import numpy as np
import pycuda.driver as cuda

from tinyvllm.backends.base import Backend, Batch, Logprobs, SamplerOutput, SamplingBatch
from tinyvllm.backends.cuda import kernels
from tinyvllm.backends.cuda.cublas import Cublas
from tinyvllm.backends.cuda.graphs import Graph
from tinyvllm.backends.cuda.linear import Linear
from tinyvllm.config import EngineConfig
from tinyvllm.model.dtypes import f32_to_bf16
from tinyvllm.model.rope import rope_cos_sin, rope_inv_freq

log = logging.getLogger(__name__)

GIB = 1 << 30
WORKSPACE_BYTES = 32 << 20  # cuBLAS workspace, fixed so that captured GEMMs never allocate
MAX_SPLITS = 32  # decode attention: most context splits of one sequence
MAX_TOP_LOGPROBS = 64  # cuda/sampling.cu MAX_TOP_LOGPROBS
HEAD_DIMS = (64, 128)


class Staging:
    """Named 4-byte arrays packed in one device buffer and pinned host buffers: a step's inputs travel in one
    copy (the last field is copied only as far as it is used), its outputs come back from fixed places. Outputs
    have two host copies used in turn: step N's stay readable while step N+1's are already queued."""

    def __init__(self, fields: dict[str, tuple[int, type]], host_copies: int = 1) -> None:
        self.offsets: dict[str, int] = {}
        total = 0
        for name, (size, _) in fields.items():
            self.offsets[name] = total
            total += size
        self.hosts = [cuda.pagelocked_empty(total, np.int32) for _ in range(host_copies)]
        self.host = self.hosts[0]
        self.dev = cuda.mem_alloc(total * 4)
        self.copies = [{name: host[self.offsets[name]: self.offsets[name] + size].view(dtype)
                        for name, (size, dtype) in fields.items()} for host in self.hosts]
        self.views = self.copies[0]
        self.copied = cuda.Event()

    def __getitem__(self, name: str) -> np.ndarray:
        return self.views[name]

    def ptr(self, name: str, index: int = 0) -> int:
        return int(self.dev) + 4 * (self.offsets[name] + index)

    def wait(self) -> None:
        """Block until the last upload has left the host buffer (call before refilling it)."""
        self.copied.synchronize()

    def upload(self, stream: cuda.Stream, last_field: str, used: int) -> None:
        cuda.memcpy_htod_async(self.dev, self.host[: self.offsets[last_field] + used], stream)
        self.copied.record(stream)

    def download(self, stream: cuda.Stream, name: str, count: int, copy: int = 0) -> None:
        cuda.memcpy_dtoh_async(self.copies[copy][name][:count], self.ptr(name), stream)


class CudaBackend(Backend):
    name = "cuda"
    max_logprobs = MAX_TOP_LOGPROBS

    def __init__(self, model, engine_config: EngineConfig, use_graphs: bool = True) -> None:
        cfg = self.config = model.config
        self.engine_config = engine_config
        self.use_graphs = use_graphs
        if cfg.head_dim not in HEAD_DIMS:
            raise ValueError(f"the cuda backend supports head_dim {HEAD_DIMS}, not {cfg.head_dim}")
        if cfg.hidden_size % 8 or cfg.intermediate_size % 8:
            raise ValueError("the cuda backend needs hidden_size and intermediate_size divisible by 8")
        self.kernels = kernels.load()
        self.stream = cuda.Stream()
        device = cuda.Context.get_device()
        self.device_name = device.name()
        self.num_sms = device.get_attribute(cuda.device_attribute.MULTIPROCESSOR_COUNT)

        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.group = self.heads // self.kv_heads
        # decode attention: query heads per block (the rows of its mma tile in use: 8 or 16), blocks per KV head
        self.heads_per_block = 8 if self.group <= 8 else 16
        self.head_chunks = -(-self.group // self.heads_per_block)
        self.q_width = self.heads * self.head_dim
        self.kv_width = self.kv_heads * self.head_dim
        self.qkv_width = self.q_width + 2 * self.kv_width
        self.scale = 1.0 / math.sqrt(self.head_dim)
        self.max_seqs = engine_config.max_num_seqs
        self.max_tokens = max(engine_config.max_num_batched_tokens, engine_config.max_num_seqs)  # per prefill chunk
        self.max_blocks = -(-engine_config.max_model_len // engine_config.block_size)  # block-table width
        self.buckets = sorted({b for b in (1, 2, 4, *range(8, self.max_seqs + 1, 8)) if b < self.max_seqs}
                              | {self.max_seqs})

        self._allocations: list[cuda.DeviceAllocation] = []
        self._upload_weights(model.weights)
        self._allocate_buffers()
        self.blas = Cublas(self.stream.handle, self.buf["workspace"], WORKSPACE_BYTES)
        self.linear = Linear(self.blas, self.kernels, self.stream)  # our GEMV for a few rows, else cuBLAS
        self.graphs: dict[int, Graph] = {}
        self.num_blocks = 0
        self.k_cache: list[int] = []
        self.v_cache: list[int] = []

    # ---- memory ----------------------------------------------------------------------------------------------------

    def _alloc(self, nbytes: int) -> int:
        allocation = cuda.mem_alloc(max(nbytes, 1))
        self._allocations.append(allocation)
        return int(allocation)

    def _to_device(self, array: np.ndarray) -> int:
        allocation = cuda.to_device(np.ascontiguousarray(array))
        self._allocations.append(allocation)
        return int(allocation)

    def _upload_weights(self, w: dict[str, np.ndarray]) -> None:
        """Every weight to bf16 on the GPU, once; Q/K/V fused into one [out, in] matrix and gate/up into another."""
        cfg = self.config
        tied = w["lm_head.weight"] is w["model.embed_tokens.weight"]
        nbytes = 2 * sum(a.size for name, a in w.items() if not (tied and name == "lm_head.weight"))
        free, total = cuda.mem_get_info()
        if nbytes > free:
            raise MemoryError(f"the model's bf16 weights need {nbytes / GIB:.2f} GiB but the GPU ({self.device_name})"
                              f" has {free / GIB:.2f} of {total / GIB:.2f} GiB free")

        def bf16(name_or_array) -> int:
            array = w[name_or_array] if isinstance(name_or_array, str) else name_or_array
            return self._to_device(f32_to_bf16(array))

        self.embed = bf16("model.embed_tokens.weight")
        self.lm_head = self.embed if tied else bf16("lm_head.weight")
        self.final_norm = bf16("model.norm.weight")
        self.layers = []
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            self.layers.append({
                "input_norm": bf16(p + "input_layernorm.weight"),
                "post_norm": bf16(p + "post_attention_layernorm.weight"),
                "qkv": bf16(np.concatenate([w[p + f"self_attn.{n}_proj.weight"] for n in "qkv"])),
                "o": bf16(p + "self_attn.o_proj.weight"),
                "gate_up": bf16(np.concatenate([w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"]])),
                "down": bf16(p + "mlp.down_proj.weight"),
            })
        log.info("cuda weights: %.2f GiB bf16 on %s", nbytes / GIB, self.device_name)

    def _num_splits(self, num_seqs: int) -> int:
        """Decode attention splits each context in this many parts: enough blocks for ~2 waves of the GPU."""
        blocks = num_seqs * self.kv_heads * self.head_chunks
        return max(1, min(MAX_SPLITS, -(-2 * self.num_sms // blocks)))

    def _allocate_buffers(self) -> None:
        cfg, t, s = self.config, self.max_tokens, self.max_seqs
        hidden, inter, vocab, d = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, self.head_dim
        partial_rows = max(n * self._num_splits(n) for n in range(1, s + 1)) * self.heads
        self.buf = {name: self._alloc(nbytes) for name, nbytes in {
            "x": t * hidden * 4,  # float32 residual stream
            "h": t * hidden * 2,  # normalized activations (GEMM input)
            "qkv": t * self.qkv_width * 2,
            "attn": t * self.q_width * 2,
            "gate_up": t * 2 * inter * 2,
            "act": t * inter * 2,
            "logits": s * vocab * 4,
            "sample_hidden": s * hidden * 2,  # final-normed hidden states of the positions that sample
            "partial_o": partial_rows * d * 4,
            "partial_ml": partial_rows * 8,
            "workspace": WORKSPACE_BYTES,
        }.items()}
        cos, sin = rope_cos_sin(np.arange(self.engine_config.max_model_len), rope_inv_freq(d, cfg.rope_theta,
                                                                                   cfg.rope_scaling))
        self.cos_sin = self._to_device(np.stack([cos, sin], axis=-1))  # float2 [max_model_len, d / 2]

        sampling = {"temperature": (s, np.float32), "top_p": (s, np.float32), "top_k": (s, np.int32),
                    "min_p": (s, np.float32), "noise_keys": (s, np.uint32)}
        self.decode_in = Staging({
            "token_ids": (s, np.int32), "token_src": (s, np.int32), "positions": (s, np.int32),
            "slot_mapping": (s, np.int32),
            "context_lens": (s, np.int32), **sampling, "bt_stride": (1, np.int32),
            "block_tables": (s * self.max_blocks, np.int32)})
        max_tiles = t * self.group // 64 + s + 1
        self.prefill_in = Staging({
            "token_ids": (t, np.int32), "token_src": (t, np.int32), "positions": (t, np.int32),
            "slot_mapping": (t, np.int32),
            "query_start_loc": (s + 1, np.int32), "context_lens": (s, np.int32), "tile_seq": (max_tiles, np.int32),
            "tile_row0": (max_tiles, np.int32), "sample_rows": (s, np.int32), "lp_rows": (t, np.int32),
            "lp_targets": (t, np.int32), **sampling, "block_tables": (s * self.max_blocks, np.int32)})
        self.out = Staging({"ids": (s, np.int32), "token_lp": (t, np.float32),
                            "top_ids": (s * MAX_TOP_LOGPROBS, np.int32),
                            "top_lp": (s * MAX_TOP_LOGPROBS, np.float32)}, host_copies=2)
        self.out_copy = 0  # the host copy of `out` the next step downloads into
        self.out_ready = [cuda.Event(), cuda.Event()]  # recorded after each copy's downloads

    def kv_bytes_per_block(self) -> int:
        return 2 * self.config.num_hidden_layers * self.engine_config.block_size * self.kv_width * 2

    def init_kv_cache(self) -> int:
        """K and V of every layer, [num_blocks * block_size, kv_heads, head_dim] bf16 each, in one allocation."""
        ec = self.engine_config
        block_bytes = self.kv_bytes_per_block()
        free, total = cuda.mem_get_info()
        if ec.num_kv_blocks is not None:
            num_blocks = ec.num_kv_blocks
        else:
            num_blocks = int((free - (1 - ec.gpu_memory_utilization) * total) // block_bytes)
        if num_blocks < 1 or num_blocks * block_bytes > free:
            raise MemoryError(
                f"no room for a KV cache of {max(num_blocks, 1)} blocks ({block_bytes} bytes each): "
                f"{free / GIB:.2f} of {total / GIB:.2f} GiB free after weights and buffers, "
                f"gpu_memory_utilization={ec.gpu_memory_utilization}")
        for graph in self.graphs.values():  # they point at the old cache
            graph.close()
        self.graphs = {}
        base = self._alloc(num_blocks * block_bytes)
        cuda.memset_d32(base, 0, num_blocks * block_bytes // 4)
        layer_bytes = num_blocks * ec.block_size * self.kv_width * 2
        layers = range(self.config.num_hidden_layers)
        self.k_cache = [base + 2 * i * layer_bytes for i in layers]
        self.v_cache = [base + (2 * i + 1) * layer_bytes for i in layers]
        self.num_blocks = num_blocks
        log.info("cuda KV cache: %d blocks x %d = %d tokens, %.2f GiB", num_blocks, ec.block_size,
                 num_blocks * ec.block_size, num_blocks * block_bytes / GIB)
        if self.use_graphs:
            self.capture_graphs()
        return num_blocks

    def describe(self) -> dict:
        return {"backend": self.name, "device": self.device_name, "kv_blocks": self.num_blocks,
                "kv_cache_gib": round(self.num_blocks * self.kv_bytes_per_block() / GIB, 3), "dtype": "bfloat16",
                "cuda_graphs": self.use_graphs}

    def measure_limits(self) -> dict:
        """Device-to-device copy rate (bytes read + written) and bf16 cuBLAS GEMM rate, median of CUDA-event timings."""
        copy_bytes, n = 256 << 20, 4096  # copies far beyond the 50 MB L2; a GEMM that fills the GPU
        src, dst = cuda.mem_alloc(copy_bytes), cuda.mem_alloc(copy_bytes)
        rng = np.random.default_rng(0)
        a, b = (cuda.to_device(f32_to_bf16(rng.standard_normal((n, n), dtype=np.float32))) for _ in range(2))
        c = cuda.mem_alloc(n * n * 2)

        def median_seconds(op: Callable[[], None], repeats: int = 20) -> float:
            op()  # warm-up
            times = []
            for _ in range(repeats):
                start, end = cuda.Event(), cuda.Event()
                start.record(self.stream)
                op()
                end.record(self.stream)
                end.synchronize()
                times.append(end.time_since(start) / 1e3)
            return float(np.median(times))

        copy_s = median_seconds(lambda: cuda.memcpy_dtod_async(dst, src, copy_bytes, self.stream))
        gemm_s = median_seconds(lambda: self.blas.gemm(int(c), int(a), int(b), n, n, n))
        for allocation in (src, dst, a, b, c):
            allocation.free()
        return {"bandwidth_bytes_s": 2 * copy_bytes / copy_s, "gemm_flops": 2 * n ** 3 / gemm_s}

    def close(self) -> None:
        """Release graphs, the cuBLAS handle and device memory now rather than at garbage collection."""
        for graph in self.graphs.values():
            graph.close()
        self.graphs = {}
        self.blas.close()
        for allocation in self._allocations:
            allocation.free()
        self._allocations = []

    # ---- the forward -----------------------------------------------------------------------------------------------

    def _launch(self, name: str, grid: tuple[int, ...], block: int, *args) -> None:
        self.kernels[name](grid, (block, 1, 1), self.stream, *args)

    def _layers(self, n: int, inp: Staging, attention: Callable[[int], None]) -> None:
        """Embed n tokens and run every layer on them, the residual stream ending in buf["x"]."""
        cfg, b = self.config, self.buf
        hidden, inter, eps = cfg.hidden_size, cfg.intermediate_size, cfg.rms_norm_eps
        # tokens sampled by the previous step, which is queued before this one but not read back yet
        self._launch("resolve_tokens", (-(-n // 256),), 256, inp.ptr("token_ids"), inp.ptr("token_src"),
                     self.out.ptr("ids"), n)
        self._launch("embedding", (n,), 256, b["x"], self.embed, inp.ptr("token_ids"), hidden)
        for i, layer in enumerate(self.layers):
            self._launch("rms_norm", (n,), 256, b["h"], b["x"], layer["input_norm"], 0, hidden, eps)
            self.linear.gemm(b["qkv"], b["h"], layer["qkv"], n, self.qkv_width, hidden)
            self._launch("rope", (n,), 128, b["qkv"], inp.ptr("positions"), self.cos_sin,
                         self.heads + self.kv_heads, self.head_dim, self.qkv_width)
            self._launch("reshape_and_cache", (n,), 128, self.k_cache[i], self.v_cache[i], b["qkv"],
                         inp.ptr("slot_mapping"), self.q_width, self.kv_width, self.qkv_width)
            attention(i)
            self.linear.gemm(b["x"], b["attn"], layer["o"], n, hidden, self.q_width, out_fp32=True, accumulate=True)
            self._launch("rms_norm", (n,), 256, b["h"], b["x"], layer["post_norm"], 0, hidden, eps)
            self.linear.gemm(b["gate_up"], b["h"], layer["gate_up"], n, 2 * inter, hidden)
            self._launch("silu_and_mul", (n, -(-inter // 2048)), 256, b["act"], b["gate_up"], inter)
            self.linear.gemm(b["x"], b["act"], layer["down"], n, hidden, inter, out_fp32=True, accumulate=True)

    def _sample(self, n: int, hidden_rows: int, inp: Staging) -> None:
        """LM head on n final-normed rows, then one sampled token per row into out["ids"]."""
        cfg = self.config
        self.linear.gemm(self.buf["logits"], hidden_rows, self.lm_head, n, cfg.vocab_size, cfg.hidden_size,
                       out_fp32=True)
        self._launch("sample", (n,), 1024, self.out.ptr("ids"), self.buf["logits"], cfg.vocab_size,
                     inp.ptr("temperature"), inp.ptr("top_p"), inp.ptr("top_k"), inp.ptr("min_p"),
                     inp.ptr("noise_keys"))

    def _decode_forward(self, n: int) -> None:
        """One decode step of n (bucket-padded) sequences, inputs in decode_in: what a graph captures."""
        inp, b, d = self.decode_in, self.buf, self.head_dim
        splits = self._num_splits(n)
        name = f"attention_decode_d{d}_r{self.heads_per_block}"

        def attention(i: int) -> None:
            self._launch(name, (self.kv_heads * self.head_chunks, n, splits), 128, b["attn"], b["partial_o"],
                         b["partial_ml"], b["qkv"], self.k_cache[i], self.v_cache[i], inp.ptr("block_tables"),
                         inp.ptr("bt_stride"), inp.ptr("context_lens"), self.scale, self.heads, self.kv_heads,
                         self.engine_config.block_size, self.qkv_width, splits)
            if splits > 1:
                self._launch("attention_combine", (self.heads, n), d, b["attn"], b["partial_o"], b["partial_ml"],
                             splits)

        self._layers(n, inp, attention)
        self._launch("rms_norm", (n,), 256, b["h"], b["x"], self.final_norm, 0, self.config.hidden_size,
                     self.config.rms_norm_eps)
        self._sample(n, b["h"], inp)

    # ---- steps -----------------------------------------------------------------------------------------------------

    def execute(self, batch: Batch) -> SamplerOutput:
        return self.submit(batch)()

    def submit(self, batch: Batch) -> Callable[[], SamplerOutput]:
        """Queue the step on the stream and return at once (unless prompt logprobs are asked: they are read back
        chunk by chunk); the returned function waits for this step alone and reads its output."""
        if batch.num_seqs > self.max_seqs:
            raise ValueError(f"batch of {batch.num_seqs} sequences exceeds max_num_seqs={self.max_seqs}")
        if batch.block_tables.shape[1] > self.max_blocks:
            raise ValueError(f"block table of {batch.block_tables.shape[1]} blocks exceeds max_model_len")
        if max(batch.sampling.num_logprobs, batch.num_prompt_logprobs) > MAX_TOP_LOGPROBS:
            raise ValueError(f"at most {MAX_TOP_LOGPROBS} logprobs per token on the cuda backend")
        n, k = batch.num_seqs, batch.sampling.num_logprobs
        out, copy = self.out, self.out_copy
        self.out_copy ^= 1
        if batch.is_prefill:
            prompt_lps = self._prefill(batch, copy)
            what = f"prefill step ({n} sequences, {len(batch.token_ids)} tokens)"
        else:
            prompt_lps = {}
            what = f"decode step ({n} sequences)"
            self._decode(batch)
        if k >= 0:
            self._launch("logprobs", (n,), 1024, out.ptr("token_lp"), out.ptr("top_ids"), out.ptr("top_lp"),
                         self.buf["logits"], out.ptr("ids"), self.config.vocab_size, k)
            for name, count in (("token_lp", n), ("top_ids", n * k), ("top_lp", n * k)):
                out.download(self.stream, name, count, copy)
        out.download(self.stream, "ids", n, copy)
        ready = self.out_ready[copy]
        ready.record(self.stream)

        def wait() -> SamplerOutput:
            try:
                ready.synchronize()
            except cuda.Error as exc:
                raise RuntimeError(f"CUDA error in {what}: {exc}") from exc
            views = out.copies[copy]
            result = SamplerOutput(views["ids"][:n].copy(), prompt_logprobs=prompt_lps)
            if k >= 0:
                result.logprobs = Logprobs(views["token_lp"][:n].copy(), views["top_ids"][: n * k].reshape(n, k).copy(),
                                           views["top_lp"][: n * k].reshape(n, k).copy())
            return result

        return wait

    def _sync(self, what: str) -> None:
        try:
            self.stream.synchronize()
        except cuda.Error as exc:
            raise RuntimeError(f"CUDA error in {what}: {exc}") from exc

    @staticmethod
    def _fill_sampling(inp: Staging, sampling: SamplingBatch, n: int, total: int) -> None:
        """Sampling parameters of n sequences, then greedy padding up to total."""
        for name, pad in (("temperature", 0), ("top_p", 1), ("top_k", 0), ("min_p", 0), ("noise_keys", 0)):
            inp[name][:n] = getattr(sampling, name)
            inp[name][n:total] = pad

    def _decode(self, batch: Batch) -> None:
        bucket = next(b for b in self.buckets if b >= batch.num_seqs)  # eager pads too: graph and eager agree
        self._stage_decode(batch, bucket)
        graph = self.graphs.get(bucket) if self.use_graphs else None
        if graph is not None:
            graph.launch(self.stream.handle)
        else:
            self._decode_forward(bucket)
            if self.use_graphs:  # the eager run warmed cuBLAS up for this shape; capture it for the next steps
                self.graphs[bucket] = Graph(self.stream.handle, lambda: self._decode_forward(bucket))

    def capture_graphs(self) -> None:
        """Capture every bucket's decode graph now, as vLLM does at start-up, so that no step of a job pays for a
        capture (~10 ms each; a job whose batch shrinks as requests finish meets many buckets): for each, an eager
        warm-up step on padding rows only, then the capture."""
        start = time.perf_counter()
        none, no_floats = np.zeros(0, np.int32), np.zeros(0, np.float32)
        idle = Batch(False, none, none, none, np.zeros(1, np.int32), none, np.zeros((0, 1), np.int32),
                     SamplingBatch(no_floats, no_floats, none, no_floats, np.zeros(0, np.uint32)))
        for bucket in self.buckets:
            if bucket not in self.graphs:
                self._stage_decode(idle, bucket)
                self._decode_forward(bucket)
                self.graphs[bucket] = Graph(self.stream.handle, lambda: self._decode_forward(bucket))
        self._sync("capturing the decode graphs")
        log.info("cuda: captured %d decode graphs in %.1f s", len(self.graphs), time.perf_counter() - start)

    def _stage_decode(self, batch: Batch, bucket: int) -> None:
        """Copy a decode batch's inputs to the device, padded to `bucket` rows."""
        n = batch.num_seqs
        inp = self.decode_in
        width = batch.block_tables.shape[1]
        inp.wait()
        # Padded rows: token 0 at position 0 with a one-token context, writing nowhere (slot -1), greedy.
        sources = batch.token_sources if batch.token_sources is not None else -1
        for name, values, pad in (("token_ids", batch.token_ids, 0), ("token_src", sources, -1),
                                  ("positions", batch.positions, 0), ("slot_mapping", batch.slot_mapping, -1),
                                  ("context_lens", batch.context_lens, 1)):
            inp[name][:n] = values
            inp[name][n:bucket] = pad
        self._fill_sampling(inp, batch.sampling, n, bucket)
        inp["bt_stride"][0] = width
        tables = inp["block_tables"][: bucket * width].reshape(bucket, width)
        tables[:n] = batch.block_tables
        tables[n:] = 0
        inp.upload(self.stream, "block_tables", bucket * width)

    def _prefill(self, batch: Batch, copy: int) -> dict[int, Logprobs]:
        """Queue the prefill (chunk by chunk) and its sampling; return the prompt logprobs, if asked."""
        total = int(batch.query_start_loc[-1])
        # Prompt logprobs: the first len(targets) new positions of sequence s predict `targets`.
        qsl, targets = batch.query_start_loc, sorted(batch.prompt_logprob_targets.items())  # rows ascending
        lp_rows = np.concatenate([np.zeros(0, np.int64)] + [qsl[s] + np.arange(len(t)) for s, t in targets])
        lp_targets = np.concatenate([np.zeros(0, np.int32)] + [t for _, t in targets])
        prompt_lps: list[Logprobs] = []
        for start in range(0, total, self.max_tokens):
            end = min(total, start + self.max_tokens)
            in_chunk = (lp_rows >= start) & (lp_rows < end)
            self._prefill_chunk(batch, start, end, lp_rows[in_chunk], lp_targets[in_chunk], prompt_lps, copy)
        self._sample(batch.num_seqs, self.buf["sample_hidden"], self.prefill_in)
        result = {}
        if prompt_lps:  # rows came out in lp_rows order; cut them back into sequences
            merged = [np.concatenate([getattr(p, f) for p in prompt_lps])
                      for f in ("token_logprobs", "top_ids", "top_logprobs")]
            offset = 0
            for s, t in targets:
                result[s] = Logprobs(*(m[offset: offset + len(t)] for m in merged))
                offset += len(t)
        return result

    def _prefill_chunk(self, batch: Batch, a: int, b: int, lp_rows: np.ndarray, lp_targets: np.ndarray,
                       prompt_lps: list[Logprobs], copy: int) -> None:
        """Tokens a..b-1 of the batch through every layer; final-norm the rows that sample into sample_hidden and
        append the prompt logprobs of rows lp_rows (batch token indices in a..b-1; targets lp_targets), read back
        through host copy `copy` of the outputs."""
        qsl = batch.query_start_loc.astype(np.int64)
        s0 = int(np.searchsorted(qsl, a, side="right")) - 1
        s1 = int(np.searchsorted(qsl, b, side="left"))  # sequences s0..s1-1 have tokens in this chunk
        starts, ends = np.maximum(qsl[s0:s1], a), np.minimum(qsl[s0 + 1: s1 + 1], b)
        rows = (ends - starts) * self.group
        tiles = -(-rows // 64)
        done = np.flatnonzero(qsl[s0 + 1: s1 + 1] <= b)  # sequences (from s0) whose last token is in the chunk
        width = batch.block_tables.shape[1]

        inp, n = self.prefill_in, b - a
        inp.wait()
        for name in ("token_ids", "positions", "slot_mapping"):
            inp[name][:n] = getattr(batch, name)[a:b]
        inp["token_src"][:n] = batch.token_sources[a:b] if batch.token_sources is not None else -1
        inp["query_start_loc"][: s1 - s0 + 1] = np.append(starts, ends[-1]) - a
        # a chunk that ends inside a sequence sees that sequence's context only up to the chunk's end
        inp["context_lens"][: s1 - s0] = batch.context_lens[s0:s1] - (qsl[s0 + 1: s1 + 1] - ends)
        inp["tile_seq"][: tiles.sum()] = np.repeat(np.arange(s1 - s0), tiles)
        inp["tile_row0"][: tiles.sum()] = np.concatenate([np.arange(t) * 64 for t in tiles])
        inp["sample_rows"][: len(done)] = qsl[s0 + 1 + done] - 1 - a
        inp["lp_rows"][: len(lp_rows)] = lp_rows - a
        inp["lp_targets"][: len(lp_rows)] = lp_targets
        self._fill_sampling(inp, batch.sampling, batch.num_seqs, batch.num_seqs)
        inp["block_tables"][: (s1 - s0) * width] = batch.block_tables[s0:s1].ravel()
        inp.upload(self.stream, "block_tables", (s1 - s0) * width)

        def attention(i: int) -> None:
            self._launch(f"attention_prefill_d{self.head_dim}", (int(tiles.sum()), self.kv_heads), 128,
                         self.buf["attn"], self.buf["qkv"], self.k_cache[i], self.v_cache[i],
                         inp.ptr("block_tables"), width, inp.ptr("query_start_loc"), inp.ptr("context_lens"),
                         inp.ptr("tile_seq"), inp.ptr("tile_row0"), self.scale, self.heads, self.kv_heads,
                         self.engine_config.block_size, self.qkv_width)

        self._layers(n, inp, attention)
        cfg, buf = self.config, self.buf
        if len(done):  # their rows of sample_hidden start at sequence s0
            self._launch("rms_norm", (len(done),), 256, buf["sample_hidden"] + s0 * cfg.hidden_size * 2, buf["x"],
                         self.final_norm, inp.ptr("sample_rows"), cfg.hidden_size, cfg.rms_norm_eps)
        k = batch.num_prompt_logprobs
        for g in range(0, len(lp_rows), self.max_seqs):
            m = min(self.max_seqs, len(lp_rows) - g)
            self._launch("rms_norm", (m,), 256, buf["h"], buf["x"], self.final_norm, inp.ptr("lp_rows", g),
                         cfg.hidden_size, cfg.rms_norm_eps)
            self.linear.gemm(buf["logits"], buf["h"], self.lm_head, m, cfg.vocab_size, cfg.hidden_size, out_fp32=True)
            self._launch("logprobs", (m,), 1024, self.out.ptr("token_lp"), self.out.ptr("top_ids"),
                         self.out.ptr("top_lp"), buf["logits"], inp.ptr("lp_targets", g), cfg.vocab_size, k)
            for name, count in (("token_lp", m), ("top_ids", m * k), ("top_lp", m * k)):
                self.out.download(self.stream, name, count, copy)
            self._sync(f"prompt logprobs of prefill tokens {a}..{b - 1}")
            views = self.out.copies[copy]
            prompt_lps.append(Logprobs(views["token_lp"][:m].copy(), views["top_ids"][: m * k].reshape(m, k).copy(),
                                       views["top_lp"][: m * k].reshape(m, k).copy()))
