"""bench/profile_step.py's chain arithmetic (--chain), on made-up kernel times: the script imports no pycuda until
it runs on a GPU."""

import sys
from pathlib import Path

import pytest

from helpers import load_script

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "profile_step.py"


@pytest.fixture(scope="module")
def profile_step():
    return load_script(SCRIPT, "profile_step")


def test_chain_times_count_what_each_kernel_adds_to_the_chain(profile_step):
    # two complete steps (and the start of a third); "b" starts before "a" ends, as programmatic launch lets it,
    # and "c" ends inside "b": it adds nothing
    kernels = [(0, 2, "first"), (1, 5, "a"), (4, 6, "b"), (4.5, 5.5, "c"),
               (10, 11, "first"), (10.5, 14, "a"), (12, 15, "b"), (12.5, 13, "c"), (20, 21, "first")]
    step, times = profile_step.chain_times(list(reversed(kernels)), "first")  # any order
    assert step == 10
    # step 1 counts "first" from its own start (2), step 2 from the end of the step before it (11 - 6 = 5)
    assert times == {"first": (1, 3.5), "a": (1, 3.0), "b": (1, 1.0), "c": (1, 0.0)}
    assert list(times) == ["first", "a", "b", "c"]  # largest first


def test_chain_times_needs_two_steps(profile_step):
    with pytest.raises(ValueError, match="fewer than two steps beginning with first among 2 kernels"):
        profile_step.chain_times([(0, 1, "first"), (1, 2, "a")], "first")


def test_chain_without_pytorch_says_so_in_one_line(profile_step, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch.profiler fails as without PyTorch
    monkeypatch.setitem(sys.modules, "torch.profiler", None)
    with pytest.raises(SystemExit, match=r"^--chain needs PyTorch \(its profiler reads"):
        profile_step.chain(llm=None, steps=3)  # refused before the LLM is touched
