"""DecodeGraphs: the CUDA graphs of the decode steps, one per batch-size bucket (forward.decode_buckets), in two
kinds: through sampling, and up to the logits (steps whose rows have structured-output masks sample after them).

A step pads its rows to the least bucket that holds them (bucket()) and replays that bucket's graph (run()). The
graphs are captured all at start-up (cuda_graph_capture="eager"), or batch 1's at start-up and the others by a
thread of their own while the engine runs ("lazy", GraphCapturer), the buckets steps ask for first; a step whose
graph is not there yet runs the same launches eagerly. A capture records and runs nothing, so it can happen while
steps are queued. The graphs read the step buffers whose pointers they captured: whoever re-makes a buffer closes
them first (close()) and starts capture again (start()).
"""

from __future__ import annotations

import bisect
import logging
import threading
import time
import weakref
from collections.abc import Callable

import pycuda.driver as cuda

from tinyvllm.backends.cuda.device import Device
from tinyvllm.backends.cuda.driver import Graph
from tinyvllm.backends.cuda.forward import CudaForward, decode_buckets

log = logging.getLogger(__name__)

# record(forward, bucket, sample): queue one decode step of `bucket` rows on forward's stream, reading the backend's
# step buffers (what a graph captures)
Record = Callable[[CudaForward, int, bool], None]


class DecodeGraphs:
    """The decode graphs of one backend, per bucket; `enabled` False runs every step eagerly."""

    def __init__(self, device: Device, stream: cuda.Stream, forward: CudaForward, record: Record, max_seqs: int,
                 enabled: bool = True) -> None:
        self.device, self.stream, self.forward, self.record = device, stream, forward, record
        self.buckets = decode_buckets(max_seqs)
        self.enabled = enabled
        self.sampled: dict[int, Graph] = {}  # through sampling
        self.forward_only: dict[int, Graph] = {}  # up to the logits
        self.capturer: GraphCapturer | None = None  # lazy capture's thread, while it runs

    def bucket(self, num_seqs: int) -> int:
        """The least bucket that holds num_seqs rows."""
        return self.buckets[bisect.bisect_left(self.buckets, num_seqs)]

    def start(self, mode: str) -> None:
        """Capture every bucket's sampling graph now ("eager", as vLLM does at start-up: no step of a job pays for
        a capture, a few ms each, at the price of a slower start), or batch 1's now (a latency run's first decode
        step should not wait for it) and the rest on a thread ("lazy")."""
        if not self.enabled:
            return
        if mode == "eager":
            start = time.perf_counter()
            for bucket in self.buckets:
                if bucket not in self.sampled:
                    self.sampled[bucket] = self.capture(bucket)
            log.info("cuda: captured %d decode graphs in %.1f s", len(self.sampled), time.perf_counter() - start)
        else:
            self.sampled[self.buckets[0]] = self.capture(self.buckets[0])
            self.capturer = GraphCapturer(self)

    @property
    def capturing(self) -> bool:
        """Whether lazy capture was started (its thread may have finished)."""
        return self.capturer is not None

    def run(self, bucket: int, sample: bool) -> None:
        """Queue a decode step of `bucket` rows: through sampling, or (sample=False) up to the logits. A bucket's
        graph not captured yet runs eagerly while the capture thread takes it, or (no thread) is captured now and
        replayed (the forward-only graphs always so)."""
        graphs = self.sampled if sample else self.forward_only
        graph = graphs.get(bucket) if self.enabled else None
        if graph is None and self.enabled:
            if sample and self.capturer is not None and self.capturer.thread.is_alive():
                self.capturer.want(bucket)
            else:
                graph = graphs[bucket] = self.capture(bucket, sample)
        if graph is None:
            self.record(self.forward, bucket, sample)
        else:
            graph.launch(self.stream.handle)

    def capture(self, bucket: int, sample: bool = True) -> Graph:
        """The graph of one bucket, on the backend's stream. Capturing records the launches without running them
        (cuBLAS has its fixed workspace, and the driver loads a kernel not loaded yet during capture), so it can be
        taken while earlier steps are queued."""
        return self.device.own(Graph(self.stream.handle, lambda: self.record(self.forward, bucket, sample)))

    def wait(self) -> None:
        """Wait for lazy capture's thread to capture every bucket's graph."""
        if self.capturer is not None:
            self.capturer.thread.join()

    def close(self) -> None:
        """Stop lazy capture and give every graph back (they may read buffers about to go)."""
        capturer, self.capturer = self.capturer, None
        if capturer is not None:
            self.device.release(capturer)  # stops it
        for graph in (*self.sampled.values(), *self.forward_only.values()):
            self.device.release(graph)
        self.sampled, self.forward_only = {}, {}


class GraphCapturer:
    """Lazy capture: a thread that captures the missing sampling graphs of a DecodeGraphs, the buckets steps asked
    for first (want()), then the others from the largest down (the sizes a draining batch meets), on a stream and
    cuBLAS handle of its own. Its host time (~4 ms a graph on the H200, mostly Python recording the launches;
    instantiation runs without the GIL) overlaps the engine's: W1 with captures taken at each bucket's first step
    lost 14-17% to them on the main thread. It holds the graphs weakly (dropped with their backend, they are
    collected, and that stops it); the device owns it, so that closing the device (at close(), collection or exit)
    stops it before the memory goes."""

    def __init__(self, graphs: DecodeGraphs) -> None:
        self.graphs = weakref.ref(graphs)
        self.device = graphs.device
        self.stream = self.device.stream(non_blocking=True)
        self.forward = graphs.forward.on_stream(self.stream)
        self.todo = list(graphs.buckets)  # ascending: pop() takes the largest
        self.wanted: list[int] = []
        self.stopping = False
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="tinyvllm-graph-capture", daemon=True)
        self.device.own(self, worker=True)
        self.thread.start()

    def want(self, bucket: int) -> None:
        """A step met `bucket` without its graph: capture it next."""
        self.wanted.append(bucket)

    def _next(self, graphs: dict[int, Graph]) -> int | None:
        while self.wanted or self.todo:
            bucket = self.wanted.pop() if self.wanted else self.todo.pop()
            if bucket not in graphs:
                return bucket
        return None

    def _run(self) -> None:
        self.device.context.push()
        try:
            while not self.stopping:
                owner = self.graphs()
                bucket = None if owner is None else self._next(owner.sampled)
                if bucket is None:
                    break
                record = owner.record
                owner.sampled[bucket] = owner.device.own(
                    Graph(self.stream.handle, lambda: record(self.forward, bucket, True)))
                del owner, record
        except Exception as exc:  # noqa: BLE001 - the main thread captures what is left itself
            self.error = exc
            log.warning("cuda: capturing decode graphs in the background failed: %s", exc)
        finally:
            self.forward.close()
            cuda.Context.pop()

    def stop(self) -> None:
        """Stop after the capture in progress."""
        self.stopping = True
        if threading.current_thread() is not self.thread:
            self.thread.join()

    close = stop
