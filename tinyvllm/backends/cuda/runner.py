"""CudaBackend: the step driver of the Llama forward on one NVIDIA GPU (forward.py), over a paged KV cache in device
memory.

Prefill runs eagerly, in chunks of at most max(max_num_batched_tokens, max_num_seqs) tokens (a longer prompt is
computed chunk by chunk: its earlier chunks' K/V are already in the cache). Decode steps replay CUDA graphs, one
per batch-size bucket (graphs.py: captured at start-up or by a thread while the engine runs). Each step copies its
inputs into fixed device buffers with one host-to-device copy and its outputs back with one.

submit() only queues a step: the engine prepares step N+1 while the GPU runs step N. A decode that continues a
sequence whose last token step N is still sampling reads that token on the GPU (resolve_tokens), and step N's
outputs come back through one of two host copies, so they stay readable after step N+1 is queued.
"""

from __future__ import annotations

import functools
import logging
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import pycuda.driver as cuda

from tinyvllm.backends.base import (Backend, Batch, LogitsProcessing, Logprobs, QueuedStep, SamplerOutput,
                                    SamplingBatch, bitmask_words)
from tinyvllm.backends.cuda.device import Device
from tinyvllm.backends.cuda.driver import Graph
from tinyvllm.backends.cuda.forward import CudaForward
from tinyvllm.backends.cuda.graphs import DecodeGraphs
from tinyvllm.backends.cuda.kernels import needed_kernels
from tinyvllm.backends.cuda.ops import MAX_TOP_LOGPROBS, max_prefill_tiles, prefill_tiles
from tinyvllm.backends.cuda.weights import GIB, fp8_weights
from tinyvllm.config import EngineConfig

log = logging.getLogger(__name__)


def _record_decode(decode_in: Staging, out: Staging, proc: ProcessorArrays, forward: CudaForward, bucket: int,
                   sample: bool) -> None:
    """One decode step of `bucket` rows from the step buffers (what DecodeGraphs captures): a function of them
    alone, so that the graphs do not hold the backend."""
    forward.decode(bucket, decode_in, out, proc, sample)

PROCESSOR_LIST_ROWS = 1 << 16  # allowed ids, and bias entries, of one step's logits processors (grown if needed)


def _seconds(work: Callable[[], object]) -> float:
    start = time.perf_counter()
    work()
    return time.perf_counter() - start


class Field(NamedTuple):
    """A Staging field: `size` 4-byte values of `dtype`; `pad`, what its padding rows hold (rows that do nothing:
    a decode bucket's rows past the batch's)."""

    size: int
    dtype: type = np.int32
    pad: int | float = 0


class Staging:
    """Named 4-byte arrays (Fields, or (size, dtype) pairs) packed in one device buffer and pinned host buffers: a
    step's inputs travel in one copy (the last field is copied only as far as it is used), its outputs come back
    from fixed places. Outputs have two host copies used in turn: step N's stay readable while step N+1's are
    already queued. The memory is the device's (freed by close(), or with the device)."""

    def __init__(self, device: Device, fields: dict[str, Field | tuple], host_copies: int = 1) -> None:
        self.device = device
        self.fields = {name: Field(*spec) for name, spec in fields.items()}
        self.offsets: dict[str, int] = {}
        total = 0
        for name, field in self.fields.items():
            self.offsets[name] = total
            total += field.size
        self.hosts = [device.pinned(total, np.int32) for _ in range(host_copies)]
        self.host = self.hosts[0]
        self.dev = device.alloc(total * 4)
        self.copies = [{name: host[self.offsets[name]: self.offsets[name] + f.size].view(f.dtype)
                        for name, f in self.fields.items()} for host in self.hosts]
        self.views = self.copies[0]
        self.copied = cuda.Event()

    def __getitem__(self, name: str) -> np.ndarray:
        return self.views[name]

    def put(self, name: str, values, n: int, total: int) -> None:
        """values in rows 0..n-1 of field `name`, its padding in rows n..total-1."""
        view = self.views[name]
        view[:n] = values
        view[n:total] = self.fields[name].pad

    def pad(self, name: str, start: int = 0, stop: int | None = None) -> None:
        """The field's padding in rows start..stop-1 (default: all)."""
        self.views[name][start:stop] = self.fields[name].pad

    def ptr(self, name: str, index: int = 0) -> int:
        return self.dev + 4 * (self.offsets[name] + index)

    def wait(self) -> None:
        """Block until the last upload has left the host buffer (call before refilling it): every step's staging
        begins here, so a step on a closed backend stops here, before it touches freed memory."""
        self.device.check_open()
        self.copied.synchronize()

    def upload(self, stream: cuda.Stream, last_field: str, used: int) -> None:
        cuda.memcpy_htod_async(self.dev, self.host[: self.offsets[last_field] + used], stream)
        self.copied.record(stream)

    def download(self, stream: cuda.Stream, name: str, count: int, copy: int = 0) -> None:
        """Queue the copy of `count` words from field `name`'s start (on into the fields after it) into host copy
        `copy`."""
        start = self.offsets[name]
        cuda.memcpy_dtoh_async(self.hosts[copy][start: start + count], self.ptr(name), stream)

    def size(self, name: str) -> int:
        return len(self.views[name])

    def close(self) -> None:
        """Free the buffers now (after wait(): no upload may still read them)."""
        if not self.device.closed:
            self.device.free(self.dev)
            for host in self.hosts:
                self.device.free_pinned(host)


def processor_row_fields(max_seqs: int) -> dict[str, Field]:
    """A step's LogitsProcessing row by row, as Staging fields: they travel in the step's input Staging, uploaded
    with its other inputs in one copy. A padding row has no penalty and counts nothing (slots -1), takes no last
    token from the previous step (last_src -1) and empty allowed and bias ranges."""
    s = max_seqs
    return {"penalty_slots": Field(s, np.int32, -1), "count_slots": Field(s, np.int32, -1),
            "presence": Field(s, np.float32), "frequency": Field(s, np.float32), "repetition": Field(s, np.float32, 1),
            "last_tokens": Field(s), "last_src": Field(s, np.int32, -1), "allowed_ptr": Field(s + 1),
            "bias_ptr": Field(s + 1)}


def sampling_fields(max_seqs: int) -> dict[str, Field]:
    """A step's sampling parameters as Staging fields; a padding row is greedy."""
    s = max_seqs
    return {"temperature": Field(s, np.float32), "top_p": Field(s, np.float32, 1), "top_k": Field(s),
            "min_p": Field(s, np.float32), "noise_keys": Field(s, np.uint32)}


@dataclass(frozen=True)
class PackedLogprobs:
    """Where n rows of logprobs (top k) go in a step's outputs (the backend's `out` Staging): packed at the start of
    its "logprobs" field, n floats (the tokens' own), n * k ids, n * k floats, so that a step's sampled ids (the
    "ids" field before it) and their logprobs come back in one copy."""

    n: int
    k: int

    def ptrs(self, out: Staging) -> tuple[int, int, int]:
        """The device pointers of the three arrays, as ops.logprobs takes them."""
        token_lp = out.ptr("logprobs")
        return token_lp, token_lp + 4 * self.n, token_lp + 4 * self.n * (1 + self.k)

    @property
    def words(self) -> int:
        return self.n * (1 + 2 * self.k)

    def read(self, out: Staging, copy: int) -> Logprobs:
        """The rows from host copy `copy`, once they have arrived."""
        n, k = self.n, self.k
        words = out.copies[copy]["logprobs"][: self.words]
        return Logprobs(words[:n].view(np.float32).copy(), words[n: n * (1 + k)].reshape(n, k).copy(),
                        words[n * (1 + k):].view(np.float32).reshape(n, k).copy())


class ProcessorBuffers:
    """A step's LogitsProcessing on the device: its per-row fields in the step's input Staging
    (processor_row_fields), written by stage(); the allowed-id and bias lists in two Stagings of their own (re-made
    larger when a step needs it; the decode graphs are captured again then)."""

    LISTS = ("allowed_ids", "bias")
    ROWS = tuple(processor_row_fields(1))

    def __init__(self, device: Device, list_rows: int) -> None:
        self.device = device
        self.grow(list_rows)
        # what each input Staging's row fields hold (by its id): a LogitsProcessing and the rows padded for; the
        # engine hands the same one to the steps of an unchanged decode run, whose rows then change only in their
        # last tokens
        self.staged: dict[int, tuple[LogitsProcessing, int]] = {}

    def grow(self, list_rows: int) -> None:
        """(Re-)make the lists for list_rows entries each (after close(): nothing may read the old ones)."""
        self.allowed = Staging(self.device, {"allowed_ids": (list_rows, np.int32)})
        self.bias = Staging(self.device, {"bias": (3 * list_rows, np.int32)})  # triples: id, float bits, condition
        self.listed: LogitsProcessing | None = None  # whose lists they hold

    def reset(self, inp: Staging) -> None:
        """Pad every row of inp's processor fields (after inp.wait()): rows that do nothing."""
        for name in self.ROWS:
            inp.pad(name)
        self.staged.pop(id(inp), None)

    def clear(self, inp: Staging) -> None:
        """A step without processors: pad inp's rows if they hold an earlier step's (whatever its row count)."""
        if id(inp) in self.staged:
            self.reset(inp)

    def stage(self, stream: cuda.Stream, inp: Staging, proc: LogitsProcessing, last_tokens: np.ndarray,
              last_src: np.ndarray, rows: int) -> None:
        """Write proc's rows into inp's row fields (after inp.wait()), then rows of padding up to `rows`, and
        upload its lists; where inp and the lists hold proc already, only its rows' last tokens."""
        n = len(proc.penalty_slots)
        held = self.staged.get(id(inp))
        if held is None or held[0] is not proc or held[1] != rows:
            self._write_rows(inp, proc, rows)
        inp["last_tokens"][:n], inp["last_src"][:n] = last_tokens, last_src
        if proc is not self.listed:
            self._upload_lists(stream, proc)

    def _write_rows(self, inp: Staging, proc: LogitsProcessing, rows: int) -> None:
        n = len(proc.penalty_slots)
        for name in ("penalty_slots", "count_slots", "presence", "frequency", "repetition"):
            inp.put(name, getattr(proc, name), n, rows)
        for name in ("last_tokens", "last_src"):
            inp.pad(name, n, rows)
        for name in ("allowed_ptr", "bias_ptr"):  # padding rows: empty ranges at the lists' end
            inp[name][: n + 1] = getattr(proc, name)
            inp[name][n + 1: rows + 1] = getattr(proc, name)[-1]
        self.staged[id(inp)] = proc, rows

    def _upload_lists(self, stream: cuda.Stream, proc: LogitsProcessing) -> None:
        self.listed = proc
        if len(proc.allowed_ids):
            self.allowed.wait()
            self.allowed["allowed_ids"][: len(proc.allowed_ids)] = proc.allowed_ids
            self.allowed.upload(stream, "allowed_ids", len(proc.allowed_ids))
        if len(proc.bias_ids):
            self.bias.wait()
            triples = self.bias["bias"][: 3 * len(proc.bias_ids)].reshape(-1, 3)
            triples[:, 0], triples[:, 1], triples[:, 2] = proc.bias_ids, proc.bias_values.view(np.int32), \
                proc.bias_cond
            self.bias.upload(stream, "bias", 3 * len(proc.bias_ids))

    def arrays(self, inp: Staging) -> ProcessorArrays:
        """The Buffers the forward reads a step's processors from: inp's row fields and these lists."""
        return ProcessorArrays(inp, self)

    def ptr(self, name: str, index: int = 0) -> int:
        return (self.allowed if name == "allowed_ids" else self.bias).ptr(name, index)

    def close(self) -> None:
        """Free the lists (grow() makes them anew)."""
        for staging in (self.allowed, self.bias):
            staging.wait()
            staging.close()


class ProcessorArrays:
    """A step's processor arrays by name, as the forward reads them (Buffers): the lists from ProcessorBuffers, the
    rest from the step's input Staging."""

    def __init__(self, inp: Staging, lists: ProcessorBuffers) -> None:
        self.inp, self.lists = inp, lists

    def ptr(self, name: str, index: int = 0) -> int:
        return (self.lists if name in ProcessorBuffers.LISTS else self.inp).ptr(name, index)


class CudaBackend(Backend):
    """The step driver: stages each step's inputs, runs the forward's prefill chunks and decode graphs, and reads
    the outputs back."""

    name = "cuda"
    max_logprobs = MAX_TOP_LOGPROBS

    def __init__(self, model, engine_config: EngineConfig, use_graphs: bool = True,
                 device: Device | None = None) -> None:
        """device: the GPU to run on (default: device 0, with programmatic launch); the backend owns it: close(),
        and the backend's collection, close it, which gives back every byte the backend holds there."""
        self.config = model.config
        self.vocab_size = model.config.vocab_size
        self.engine_config = engine_config
        self.max_seqs = engine_config.max_num_seqs
        self.max_tokens = max(engine_config.max_num_batched_tokens, engine_config.max_num_seqs)  # per prefill chunk
        self.max_blocks = -(-engine_config.max_model_len // engine_config.block_size)  # block-table width
        self.use_graphs = use_graphs  # with graphs, or every decode step eagerly
        self.masks: Staging | None = None  # structured outputs' bitmasks, allocated at the first step with any
        self.num_blocks = 0
        cfg = model.config
        needed = needed_kernels(cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads,
                                engine_config.fp8_kv_cache, fp8_weights(model, engine_config), cfg.activation,
                                cfg.num_experts > 0, engine_config.batch_invariant)
        # seconds per start-up phase, for `tinyvllm bench --startup`
        start = time.perf_counter()
        # the kernels build on a thread from here on (before the context is made), while the weights upload
        self.device = device or Device(0, prepare=needed)
        self.device.prepare_kernels(needed)  # a device given (one made here is building them already)
        self.startup_times: dict[str, float] = {"cuda context": time.perf_counter() - start}
        # collected or at exit, the device is closed too (the finalizer holds the device, never the backend)
        self._finalizer = weakref.finalize(self, self.device.close)
        try:
            self._build(model)
        except BaseException:
            self._finalizer()
            raise

    def _build(self, model) -> None:
        self.stream = self.device.stream()
        start = time.perf_counter()
        self.forward = CudaForward(model, self.engine_config, self.device, self.stream,
                                   self.max_tokens)  # uploads the weights, then waits for the kernels
        self.startup_times["kernels"] = self.device.kernel_wait  # what the build took beyond the upload
        self.startup_times["weights upload"] = time.perf_counter() - start - self.device.kernel_wait
        log.info("cuda: kernels ready in %.2f s, weights uploaded in %.2f s", self.startup_times["kernels"],
                 self.startup_times["weights upload"])
        self._allocate_staging()
        self.proc = ProcessorBuffers(self.device, PROCESSOR_LIST_ROWS)
        self.proc.reset(self.decode_in)
        self.proc.reset(self.prefill_in)
        record = functools.partial(_record_decode, self.decode_in, self.out, self.proc.arrays(self.decode_in))
        self.graphs = DecodeGraphs(self.device, self.stream, self.forward, record, self.max_seqs, self.use_graphs)
        self.copies_in = Staging(self.device, {"pairs": (2 * self.max_seqs, np.int32)})  # forks' KV block copies
        self.slots_in = Staging(self.device, {"slots": (self.max_seqs, np.int32),
                                              "token_slots": (self.max_tokens, np.int32),
                                              "tokens": (self.max_tokens, np.int32)})  # token-count slot inits

    def _allocate_staging(self) -> None:
        """A step's inputs travel in one copy: the decode or prefill fields, the sampling parameters, the logits
        processors' rows and the rows asking logprobs, then the block tables (copied only as far as used). Its
        outputs come back in one copy too: the sampled ids, then (PackedLogprobs) their logprobs."""
        t, s = self.max_tokens, self.max_seqs
        per_step = {**sampling_fields(s), **processor_row_fields(s),
                    "logprob_rows": Field(s)}  # the rows asking logprobs, when not all do
        # a decode bucket's padding row: token 0 at position 0 with a one-token context, writing nowhere (slot -1)
        self.decode_in = Staging(self.device, {
            "token_ids": Field(s), "token_src": Field(s, np.int32, -1), "positions": Field(s),
            "slot_mapping": Field(s, np.int32, -1), "context_lens": Field(s, np.int32, 1), **per_step,
            "bt_stride": Field(1), "block_tables": Field(s * self.max_blocks)})
        max_tiles = max_prefill_tiles(t, s, self.forward.group)
        self.prefill_in = Staging(self.device, {
            "token_ids": (t, np.int32), "token_src": (t, np.int32), "positions": (t, np.int32),
            "slot_mapping": (t, np.int32),
            "query_start_loc": (s + 1, np.int32), "context_lens": (s, np.int32), "tile_seq": (max_tiles, np.int32),
            "tile_row0": (max_tiles, np.int32), "sample_rows": (s, np.int32), "lp_rows": (t, np.int32),
            "lp_targets": (t, np.int32), **per_step, "block_tables": (s * self.max_blocks, np.int32)})
        self.out = Staging(self.device, {"ids": (s, np.int32), "logprobs": (s * (1 + 2 * MAX_TOP_LOGPROBS), np.int32)},
                           host_copies=2)
        self.sampling_staged: dict[int, tuple] = {}  # what each input Staging holds (by id): _fill_sampling's
        self.out_copy = 0  # the host copy of `out` the next step downloads into
        self.out_ready = [cuda.Event(), cuda.Event()]  # recorded after each copy's downloads

    def kv_bytes_per_block(self) -> int:
        return self.forward.kv_bytes_per_block()

    def init_kv_cache(self) -> int:
        """K and V of every layer, [num_blocks * block_size, kv_heads, head_dim] bf16 (or e4m3) each, in one
        allocation."""
        ec = self.engine_config
        block_bytes = self.kv_bytes_per_block()
        self.graphs.close()  # they point at the old cache, if there is one: it goes before the count of what is free
        self.forward.free_kv_cache()
        free, total = self.device.mem_get_info()
        if ec.num_kv_blocks is not None:
            num_blocks = ec.num_kv_blocks
        else:
            num_blocks = int((free - (1 - ec.gpu_memory_utilization) * total) // block_bytes)
        if num_blocks < 1 or num_blocks * block_bytes > free:
            raise MemoryError(
                f"no room for a KV cache of {max(num_blocks, 1)} blocks ({block_bytes} bytes each): "
                f"{free / GIB:.2f} of {total / GIB:.2f} GiB free after weights and buffers, "
                f"gpu_memory_utilization={ec.gpu_memory_utilization}")
        self.startup_times["KV cache allocation"] = _seconds(lambda: self.forward.allocate_kv_cache(num_blocks))
        self.num_blocks = num_blocks
        log.info("cuda KV cache: %d blocks x %d = %d tokens, %.2f GiB", num_blocks, ec.block_size,
                 num_blocks * ec.block_size, num_blocks * block_bytes / GIB)
        forward = self.forward
        candidates = forward.linear.chain_shapes or forward.chain8_candidates
        if forward.invariant and candidates and not forward.chain_timings:
            self.startup_times["gemv_chain choice"] = _seconds(self._choose_chain_shapes)
        self.startup_times["LM head tuning"] = _seconds(lambda: self.forward.tune_lm_head(self.graphs.buckets))
        if self.use_graphs:
            self.startup_times["graph capture"] = _seconds(lambda: self.graphs.start(ec.cuda_graph_capture))
        return num_blocks

    def _choose_chain_shapes(self) -> None:
        """Batch-invariant: time batch-1 decode steps for CudaForward.choose_chain_shapes, each a graph captured with
        its chain shapes (or, without graphs, the same launches queued eagerly), on a padding row: token 0 at
        position 0 with a one-token context, writing no KV slot (the KV cache is allocated). Before any decode
        graph is kept: those capture the shapes chosen."""
        inp = self.decode_in
        inp.wait()
        for name in inp.fields:
            inp.pad(name)
        inp["bt_stride"][0] = 1
        inp.upload(self.stream, "block_tables", 1)
        made: dict[tuple[frozenset, frozenset], Graph] = {}  # a graph per (chain, chain8): the pair kept for one
                                                           # shape is the next shape's step with its chain

        def step_with(chain: frozenset, chain8: frozenset) -> Callable[[], None]:
            def eager() -> None:
                self.forward.linear.chain_shapes, self.forward.linear.chain8_shapes = set(chain), set(chain8)
                self.graphs.record(self.forward, 1, True)

            if not self.use_graphs:
                return eager
            if (chain, chain8) not in made:
                self.forward.linear.chain_shapes, self.forward.linear.chain8_shapes = set(chain), set(chain8)
                made[chain, chain8] = self.graphs.capture(1)
            return functools.partial(made[chain, chain8].launch, self.stream.handle)

        try:
            self.forward.choose_chain_shapes(step_with)
        finally:
            self.stream.synchronize()
            for graph in made.values():
                self.device.release(graph)

    def finish_startup(self) -> None:
        """Wait for lazy capture's thread to capture every bucket's decode graph."""
        self.graphs.wait()

    def describe(self) -> dict:
        return {"backend": self.name, "device": self.forward.device_name, "kv_blocks": self.num_blocks,
                "kv_cache_gib": round(self.num_blocks * self.kv_bytes_per_block() / GIB, 3), "dtype": "bfloat16",
                "kv_cache_dtype": "fp8_e4m3" if self.engine_config.fp8_kv_cache else "bfloat16",
                "cuda_graphs": self.use_graphs}

    def close(self) -> None:
        """Give the GPU back now rather than at garbage collection: the graphs and the capture thread, the KV cache,
        weights, buffers, pinned host memory, cuBLAS handles, kernels and streams (the device's, which this closes).
        Idempotent; a step after it raises DeviceClosedError."""
        if not self.device.closed:
            self.graphs.close()
        self._finalizer()

    # ---- steps -----------------------------------------------------------------------------------------------------

    def execute(self, batch: Batch, bitmask: np.ndarray | None = None) -> SamplerOutput:
        queued = self.submit(batch)
        if queued.sample is not None:
            queued.bitmask[:] = bitmask
            queued.sample()
        return queued.result()

    def submit(self, batch: Batch) -> QueuedStep:
        """Queue the step on the stream and return at once (unless prompt logprobs are asked: they are read back
        chunk by chunk); its result() waits for this step alone and reads its output. With bitmask rows, the
        forward is queued up to the logits; the sampling is queued by sample(), after the masks."""
        self._check(batch)
        n, k = batch.num_seqs, batch.sampling.num_logprobs
        prefill = batch.max_query_len > 1  # else one token per sequence: the decode graphs (one sampled row each)
        out, copy = self.out, self.out_copy
        self.out_copy ^= 1
        if batch.block_copies is not None:
            self._copy_blocks(batch.block_copies)
        rows = n if prefill else self.graphs.bucket(n)
        inp = self.prefill_in if prefill else self.decode_in
        inp.wait()  # the last step's upload has left its host buffer
        self._stage_processing(batch, inp, rows)
        lp_rows, lp_ptr = self._stage_logprob_rows(inp, batch.sampling, n)
        packed = PackedLogprobs(n, k)
        deferred = batch.bitmask_rows is not None
        if prefill:
            prompt_lps = self._prefill(batch, copy)
            what = f"prefill step ({n} sequences, {len(batch.token_ids)} tokens)"
        else:
            prompt_lps = {}
            what = f"decode step ({n} sequences)"
            self._decode(batch, sample=not deferred)
        ready = self.out_ready[copy]

        def sample(masks: Staging | None = None) -> None:
            if prefill:
                self.forward.sample_prefill(n, inp, out, self.proc.arrays(inp), masks)
            elif masks is not None:  # else the decode graph sampled
                self.forward.sample_logits(rows, inp, out, self.proc.arrays(inp), inp.ptr("token_ids"), masks)
            if k >= 0:
                self.forward.logprobs(lp_rows, out.ptr("ids"), k, packed.ptrs(out), lp_ptr)
            # the ids, and their logprobs packed after them, in one copy
            out.download(self.stream, "ids", n if k < 0 else out.size("ids") + packed.words, copy)
            ready.record(self.stream)

        def wait() -> SamplerOutput:
            try:
                ready.synchronize()
            except cuda.Error as exc:
                raise RuntimeError(f"CUDA error in {what}: {exc}") from exc
            result = SamplerOutput.one_each(out.copies[copy]["ids"][:n].copy(), prompt_logprobs=prompt_lps)
            if k >= 0:
                result.logprobs = packed.read(out, copy)
            return result

        if not deferred:
            sample()
            return QueuedStep(wait, done=ready.query)
        masks, bitmask = self._stage_bitmask_rows(batch.bitmask_rows, rows)

        def sample_with_masks() -> None:
            masks.upload(self.stream, "bitmask", bitmask.size)
            sample(masks)

        # done() before sample_with_masks(): the event is that of an earlier step (finished), so the forward counts as
        # done; the device waits for the masks anyway.
        return QueuedStep(wait, bitmask, sample_with_masks, ready.query)

    def _stage_bitmask_rows(self, bitmask_rows: np.ndarray, rows: int) -> tuple[Staging, np.ndarray]:
        """Stage the rows' bitmask indices (padding rows: -1) and hand out the host bitmask for the caller to fill:
        [C, words] in the same pinned buffer, uploaded with them."""
        words = bitmask_words(self.vocab_size)
        if self.masks is None:
            self.masks = Staging(self.device, {"bitmask_rows": (self.max_seqs, np.int32),
                                               "bitmask": (self.max_seqs * words, np.int32)})
        masks = self.masks
        masks.wait()  # the previous step's upload has left the buffer
        masks["bitmask_rows"][: len(bitmask_rows)] = bitmask_rows
        masks["bitmask_rows"][len(bitmask_rows): rows] = -1
        num_masks = int(bitmask_rows.max()) + 1
        return masks, masks["bitmask"][: num_masks * words].reshape(num_masks, words)

    def _check(self, batch: Batch) -> None:
        """Refuse a batch beyond what the buffers were sized for."""
        if batch.num_seqs > self.max_seqs:
            raise ValueError(f"batch of {batch.num_seqs} sequences exceeds max_num_seqs={self.max_seqs}")
        if batch.block_tables.shape[1] > self.max_blocks:
            raise ValueError(f"block table of {batch.block_tables.shape[1]} blocks exceeds max_model_len")
        if max(batch.sampling.num_logprobs, batch.num_prompt_logprobs) > MAX_TOP_LOGPROBS:
            raise ValueError(f"at most {MAX_TOP_LOGPROBS} logprobs per token on the cuda backend")

    @staticmethod
    def _stage_logprob_rows(inp: Staging, sampling: SamplingBatch, n: int) -> tuple[int, int]:
        """The rows whose logprobs the step computes: (n, 0) for rows 0..n-1, or, where only some ask
        (SamplingBatch.logprob_rows; the others' rows of the outputs are left as they were), their count and their
        list, written into the step's inputs inp (after inp.wait())."""
        rows = sampling.logprob_rows
        if sampling.num_logprobs < 0 or rows is None:
            return n, 0
        inp["logprob_rows"][: len(rows)] = rows
        return len(rows), inp.ptr("logprob_rows")

    def _sync(self, what: str) -> None:
        try:
            self.stream.synchronize()
        except cuda.Error as exc:
            raise RuntimeError(f"CUDA error in {what}: {exc}") from exc

    SAMPLING_PARAMS = ("temperature", "top_p", "top_k", "min_p")  # what stays while a decode run's rows do

    def _fill_sampling(self, inp: Staging, sampling: SamplingBatch, n: int, total: int) -> None:
        """Sampling parameters of n sequences, then greedy padding up to total. The steps of an unchanged decode
        run hand the same arrays: those inp holds already are not written again (the noise keys change each step)."""
        arrays = [getattr(sampling, name) for name in self.SAMPLING_PARAMS]
        held = self.sampling_staged.get(id(inp))
        if held is None or held[0] != (n, total) or any(a is not b for a, b in zip(held[1], arrays)):
            for name, values in zip(self.SAMPLING_PARAMS, arrays):
                inp.put(name, values, n, total)
            self.sampling_staged[id(inp)] = (n, total), arrays
        inp.put("noise_keys", sampling.noise_keys, n, total)

    def _decode(self, batch: Batch, sample: bool) -> None:
        """Queue a decode step: through sampling, or (sample=False) up to the logits, its rows padded to their
        bucket (eagerly too: graph and eager agree)."""
        bucket = self.graphs.bucket(batch.num_seqs)
        self._stage_decode(batch, bucket)
        self.graphs.run(bucket, sample)

    def _copy_blocks(self, pairs: np.ndarray) -> None:
        """Forks' KV block copies, queued before the step that reads them."""
        if self.copies_in.size("pairs") < pairs.size:
            self.copies_in.wait()
            self.copies_in.close()
            self.copies_in = Staging(self.device, {"pairs": (pairs.size, np.int32)})
        self.copies_in.wait()
        self.copies_in["pairs"][: pairs.size] = pairs.ravel()
        self.copies_in.upload(self.stream, "pairs", pairs.size)
        self.forward.copy_blocks(self.copies_in.ptr("pairs"), len(pairs))

    def _stage_processing(self, batch: Batch, inp: Staging, rows: int) -> None:
        """Stage the step's LogitsProcessing for `rows` rows (the batch's, then padding that does nothing) in its
        inputs inp (after inp.wait()); a step without after one with pads inp's rows once."""
        proc = batch.logits_processing
        if proc is None:
            self.proc.clear(inp)
            return
        if proc.slot_inits:
            self._init_token_slots(proc)
        needed = max(len(proc.allowed_ids), len(proc.bias_ids))
        if needed > self.proc.allowed.size("allowed_ids"):
            lazy = self.graphs.capturing
            self.graphs.close()  # they read the old lists
            self.proc.close()
            self.proc.grow(needed)
            if lazy:
                self.graphs.start("lazy")
        last = slice(None) if batch.max_query_len == 1 else batch.query_start_loc[1:] - 1  # each row's last token
        sources = batch.token_sources[last] if batch.token_sources is not None else -1
        self.proc.stage(self.stream, inp, proc, batch.token_ids[last], sources, rows)

    def _init_token_slots(self, proc: LogitsProcessing) -> None:
        """Reset the token-count slots of sequences that just got one to their prompt and output tokens."""
        slots = np.array([slot for slot, _, _ in proc.slot_inits], np.int32)
        tokens = np.concatenate([t for _, p, o in proc.slot_inits for t in (p, o)]).astype(np.int32)
        # each token's slot: as -1 - slot for a prompt token (the prompt mask), as slot for an output token (counts)
        token_slots = np.concatenate([np.r_[np.full(len(p), -1 - slot), np.full(len(o), slot)]
                                      for slot, p, o in proc.slot_inits]).astype(np.int32)
        if self.slots_in.size("tokens") < len(tokens):
            self.slots_in.wait()
            self.slots_in.close()
            self.slots_in = Staging(self.device, {"slots": (self.max_seqs, np.int32),
                                                  "token_slots": (len(tokens), np.int32),
                                                  "tokens": (len(tokens), np.int32)})
        buffers = self.slots_in
        buffers.wait()
        buffers["slots"][: len(slots)] = slots
        buffers["token_slots"][: len(tokens)] = token_slots
        buffers["tokens"][: len(tokens)] = tokens
        buffers.upload(self.stream, "tokens", len(tokens))
        self.forward.init_token_slots(buffers.ptr("slots"), len(slots), buffers.ptr("tokens"),
                                      buffers.ptr("token_slots"), len(tokens))

    def _stage_decode(self, batch: Batch, bucket: int) -> None:
        """Copy a decode batch's inputs to the device, padded to `bucket` rows (after decode_in.wait(), with the
        rows' processors and logprob rows already written)."""
        n = batch.num_seqs
        inp = self.decode_in
        width = batch.block_tables.shape[1]
        sources = batch.token_sources if batch.token_sources is not None else -1
        for name, values in (("token_ids", batch.token_ids), ("token_src", sources), ("positions", batch.positions),
                             ("slot_mapping", batch.slot_mapping), ("context_lens", batch.context_lens)):
            inp.put(name, values, n, bucket)  # rows n.. as the fields' padding
        self._fill_sampling(inp, batch.sampling, n, bucket)
        inp["bt_stride"][0] = width
        tables = inp["block_tables"][: bucket * width].reshape(bucket, width)
        tables[:n] = batch.block_tables
        tables[n:] = 0
        inp.upload(self.stream, "block_tables", bucket * width)

    def _prefill(self, batch: Batch, copy: int) -> dict[int, Logprobs]:
        """Queue the prefill (chunk by chunk) up to the logits of its sampled rows; return the prompt logprobs,
        if asked."""
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
        self.forward.compute_logits(batch.num_seqs, self.forward.buf.sample_hidden)
        result = {}
        if prompt_lps:  # rows came out in lp_rows order; cut them back into sequences
            merged = [np.concatenate([getattr(p, f) for p in prompt_lps])
                      for f in ("token_logprobs", "top_ids", "top_logprobs")]
            offset = 0
            for s, t in targets:
                result[s] = Logprobs(*(m[offset: offset + len(t)] for m in merged))
                offset += len(t)
        return result

    def _prefill_chunk(self, batch: Batch, start: int, end: int, lp_rows: np.ndarray, lp_targets: np.ndarray,
                       prompt_lps: list[Logprobs], copy: int) -> None:
        """Tokens start..end-1 of the batch through every layer (after prefill_in.wait(), with the step's processor
        and logprob rows already written); final-norm the rows that sample into sample_hidden and append the prompt
        logprobs of rows lp_rows (batch token indices in start..end-1; targets lp_targets), read back through host
        copy `copy` of the outputs."""
        qsl = batch.query_start_loc.astype(np.int64)
        s0 = int(np.searchsorted(qsl, start, side="right")) - 1
        s1 = int(np.searchsorted(qsl, end, side="left"))  # sequences s0..s1-1 have tokens in this chunk
        starts, ends = np.maximum(qsl[s0:s1], start), np.minimum(qsl[s0 + 1: s1 + 1], end)
        tile_seq, tile_row0 = prefill_tiles((ends - starts) * self.forward.group)
        num_tiles = len(tile_seq)
        done = np.flatnonzero(qsl[s0 + 1: s1 + 1] <= end)  # sequences (from s0) whose last token is in the chunk
        width = batch.block_tables.shape[1]

        inp, n = self.prefill_in, end - start
        if start > 0:  # the chunk before's upload has left the host buffer (submit waited for the first chunk's)
            inp.wait()
        for name in ("token_ids", "positions", "slot_mapping"):
            inp[name][:n] = getattr(batch, name)[start:end]
        inp["token_src"][:n] = batch.token_sources[start:end] if batch.token_sources is not None else -1
        inp["query_start_loc"][: s1 - s0 + 1] = np.append(starts, ends[-1]) - start
        # a chunk that ends inside a sequence sees that sequence's context only up to the chunk's end
        inp["context_lens"][: s1 - s0] = batch.context_lens[s0:s1] - (qsl[s0 + 1: s1 + 1] - ends)
        inp["tile_seq"][:num_tiles] = tile_seq
        inp["tile_row0"][:num_tiles] = tile_row0
        inp["sample_rows"][: len(done)] = qsl[s0 + 1 + done] - 1 - start
        inp["lp_rows"][: len(lp_rows)] = lp_rows - start
        inp["lp_targets"][: len(lp_rows)] = lp_targets
        self._fill_sampling(inp, batch.sampling, batch.num_seqs, batch.num_seqs)
        inp["block_tables"][: (s1 - s0) * width] = batch.block_tables[s0:s1].ravel()
        inp.upload(self.stream, "block_tables", (s1 - s0) * width)

        self.forward.prefill(n, inp, self.out, num_tiles, width)
        if len(done):  # their rows of sample_hidden start at sequence s0
            self.forward.norm_sample_rows(s0, inp.ptr("sample_rows"), len(done))
        k = batch.num_prompt_logprobs
        for g in range(0, len(lp_rows), self.max_seqs):
            packed = PackedLogprobs(min(self.max_seqs, len(lp_rows) - g), k)
            self.forward.prompt_logprobs(packed.n, inp.ptr("lp_rows", g), inp.ptr("lp_targets", g), k,
                                         packed.ptrs(self.out))
            self.out.download(self.stream, "logprobs", packed.words, copy)
            self._sync(f"prompt logprobs of prefill tokens {start}..{end - 1}")
            prompt_lps.append(packed.read(self.out, copy))
