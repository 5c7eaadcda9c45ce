"""The garbage collector during a run (engine/gc_scope.py): the heap frozen and full collections rarer while the
engine runs, everything restored after; and finished requests that reference counting frees alone (no cycles)."""

import gc
import threading

import pytest

from tinyvllm import LLM, SamplingParams
from tinyvllm.engine import gc_scope
from tinyvllm.engine.gc_scope import OLDEST_THRESHOLD, engine_run_gc
from tinyvllm.engine.sequence import Sequence, SequenceGroup


@pytest.fixture
def thresholds():
    saved = gc.get_threshold()
    gc.set_threshold(700, 10, 10)
    yield
    gc.set_threshold(*saved)


def test_a_run_freezes_the_heap_and_restores_the_collector(thresholds):
    before = gc.get_freeze_count()
    held = [[i] for i in range(1000)]  # tracked containers alive at the run's start
    with engine_run_gc():
        assert gc.get_threshold() == (700, 10, OLDEST_THRESHOLD)
        assert gc.get_freeze_count() >= before + len(held)
        with engine_run_gc():  # nested (or another thread's run): the first to enter set it up
            pass
        assert gc.get_threshold() == (700, 10, OLDEST_THRESHOLD) and gc.get_freeze_count() > before
    assert gc.get_threshold() == (700, 10, 10) and gc.get_freeze_count() == 0
    with pytest.raises(KeyError), engine_run_gc():
        raise KeyError("a failing run restores it too")
    assert gc.get_threshold() == (700, 10, 10) and gc.get_freeze_count() == 0 and gc_scope._runs == 0


def test_overlapping_runs_restore_once_the_last_ends(thresholds):
    entered, release = threading.Event(), threading.Event()

    def other_run():
        with engine_run_gc():
            entered.set()
            release.wait(10)

    thread = threading.Thread(target=other_run)
    thread.start()
    assert entered.wait(10)
    with engine_run_gc():
        pass
    assert gc.get_threshold()[2] == OLDEST_THRESHOLD  # the other run is still going
    release.set()
    thread.join()
    assert gc.get_threshold() == (700, 10, 10)


@pytest.mark.parametrize("n", [1, 2])
def test_finished_requests_hold_no_cycles(tiny_model_dir, n):
    llm = LLM(tiny_model_dir, backend="numpy", max_num_seqs=4)
    llm.generate(["warm up"], SamplingParams(max_tokens=2))
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        outputs = llm.generate(["one", "two words", "and three words"], SamplingParams(max_tokens=4, n=n, seed=1))
        assert len(outputs) == 3 and all(len(o.outputs) == n for o in outputs)
        del outputs
        gc.collect()
        left = [o for o in gc.garbage if isinstance(o, (Sequence, SequenceGroup))]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert left == []  # freed by reference counting as each request finished


def unfrozen_ids() -> set[int]:
    """The ids of the objects the collector tracks outside the frozen (permanent) generation."""
    return {id(o) for o in gc.get_objects()}


def test_objects_the_caller_froze_stay_frozen(thresholds):
    """A caller that froze objects itself: the run freezes nothing more (an object made after the caller's freeze
    stays collectable) and unfreezes nothing at its end. Checked object by object: the frozen count alone may drop
    while the test runs, as frozen objects die in other threads."""
    held = [[i] for i in range(100)]
    gc.freeze()
    try:
        assert gc.get_freeze_count() >= len(held) and id(held[0]) not in unfrozen_ids()
        fresh = [[i] for i in range(100)]  # tracked after the caller's freeze: a freeze by the run would take it
        with engine_run_gc():
            ids = unfrozen_ids()
            assert id(fresh[0]) in ids and id(held[0]) not in ids and gc.get_threshold()[2] == OLDEST_THRESHOLD
        assert id(held[0]) not in unfrozen_ids() and gc.get_threshold() == (700, 10, 10)
    finally:
        gc.unfreeze()
