"""bench/attention.py's arguments: bad values get one clear line (argparse's usage error), before any GPU is needed."""

from pathlib import Path

import pytest

from helpers import load_script

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "attention.py"


@pytest.fixture(scope="module")
def bench_attention():
    return load_script(SCRIPT, "bench_attention")  # imports no pycuda: that waits for main()


def test_arguments_parsed(bench_attention):
    args = bench_attention.parse_args(["--seqs", "1,512", "--context", "100,2048", "--splits", "8", "--fp8"])
    assert (args.seqs, args.context, args.splits, args.fp8) == ([1, 512], (100, 2048), 8, True)
    assert bench_attention.parse_args([]).splits is None  # the engine's parts at each batch
    assert bench_attention.parse_args([]).shape == (32, 8, 64)  # Llama-3.2-1B's
    assert bench_attention.parse_args(["--shape", "4,1,256"]).shape == (4, 1, 256)  # Gemma-3-1B's


@pytest.mark.parametrize("argv,message", [
    (["--splits", "0"], "--splits 0: a context has at least 1 part"),
    (["--seqs", "0,8"], "every batch needs a sequence"),
    (["--seqs", "a"], "integers separated by commas"),
    (["--context", "512,256"], "1 <= lo <= hi"),
    (["--context", "256"], "1 <= lo <= hi"),
    (["--shape", "32,8,80"], "head_dim one of"),
    (["--shape", "30,8,64"], "kv_heads dividing heads"),
    (["--shape", "32,8"], "give heads,kv_heads,head_dim"),
])
def test_bad_arguments_are_refused(bench_attention, capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        bench_attention.parse_args(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
