"""Python's garbage collector while the engine runs (LLM.generate / chat, a job's row loop).

The engine's thread queues the device's next step before it reads the last one, so a pause of the host longer
than a step leaves the device idle. A full collection traverses every tracked object: on a run of 20,000 requests
(J1's shape, bench/profile_job.py) the heap of the caller's prompts and the outputs gathered so far made each one
take 100-500 ms. For a run's length `engine_run_gc` therefore
- freezes the heap that exists at its start (the model's tables, the caller's data: gc.freeze), so that no
  collection traverses it, and gives it back to the oldest generation at the end (gc.unfreeze);
- collects the oldest generation 10x less often (its threshold 10 -> 100; the young generations keep theirs).
What the engine makes needs no collector to be freed: a finished request's objects hold no cycle
(output_processor breaks the one between a request's sequences and their group), so they go by reference counting.

Runs may nest or overlap (threads): the first to enter freezes and sets the threshold, the last to leave restores
both. A process that froze objects itself (gc.freeze before the run) keeps them frozen: the run then freezes
nothing, since gc.unfreeze would release the caller's objects too.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

OLDEST_THRESHOLD = 100  # gen1 collections between two full ones during a run (CPython's default is 10)

_lock = threading.Lock()
_runs = 0
_saved: tuple[int, int, int] | None = None
_froze = False  # whether the first run froze the heap (nothing was frozen before it)


@contextmanager
def engine_run_gc() -> Iterator[None]:
    """For the length of the with-block: the heap frozen and full collections rarer (the module's docstring)."""
    global _runs, _saved, _froze
    with _lock:
        _runs += 1
        if _runs == 1:
            _saved = gc.get_threshold()
            gc.set_threshold(_saved[0], _saved[1], max(_saved[2], OLDEST_THRESHOLD))
            _froze = gc.get_freeze_count() == 0
            if _froze:
                gc.freeze()
    try:
        yield
    finally:
        with _lock:
            _runs -= 1
            if _runs == 0:
                if _froze:
                    gc.unfreeze()
                gc.set_threshold(*_saved)
