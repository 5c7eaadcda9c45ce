"""The bench/*_device.sh scripts (one device call each) with a stand-in python that records each call: they build
the kernels, then run what they run with arguments the scripts' own parsers take, results under the directory
given. host_loop_device.sh: issue 38's profiles (profile_host, profile_job); invariant_device.sh: issue 43's GPU
tests, bench/batch_invariant.py on the presets given, bench/gemv.py --invariant and bench/profile_step.py at batch 1
off and on for each."""

from pathlib import Path

from helpers import load_script, run_device_script

ROOT = Path(__file__).resolve().parents[1]


def test_the_device_script_calls_the_profilers_with_arguments_they_take(tmp_path):
    results = tmp_path / "results"
    done, calls = run_device_script(ROOT / "bench" / "host_loop_device.sh", [str(results), "tiny"], tmp_path)
    assert done.returncode == 0, done.stderr
    assert calls[0] == ["-m", "tinyvllm", "build-kernels"]
    scripts = {"bench/profile_host.py": load_script(ROOT / "bench" / "profile_host.py", "profile_host"),
               "bench/profile_job.py": load_script(ROOT / "bench" / "profile_job.py", "profile_job")}
    ran = [call[0] for call in calls[1:]]
    assert ran == ["bench/profile_host.py", "bench/profile_host.py", "bench/profile_job.py"], calls
    for call in calls[1:]:
        args = scripts[call[0]].parse_args(call[1:])
        assert args.dummy_weights == "tiny"
        assert getattr(args, "json", None) is None or Path(args.json).parent == results
    assert scripts["bench/profile_job.py"].parse_args(calls[3][1:]).backend == "cuda"
    assert results.is_dir()


def test_the_invariant_script_runs_the_tests_and_benchmarks_with_arguments_they_take(tmp_path):
    results = tmp_path / "results"
    done, calls = run_device_script(ROOT / "bench" / "invariant_device.sh", [str(results), "tiny,llama-3.2-1b"],
                                     tmp_path)
    assert done.returncode == 0, done.stderr
    assert calls[0] == ["-m", "tinyvllm", "build-kernels"]
    tests = sorted(call[-1] for call in calls[1:3])  # the two pytest runs, side by side
    assert all(call[:2] == ["-m", "pytest"] for call in calls[1:3])
    assert tests == ["tests/gpu/test_attention_invariant.py", "tests/gpu/test_batch_invariant_cuda.py"]
    assert all((ROOT / test).is_file() for test in tests)
    bench = load_script(ROOT / "bench" / "batch_invariant.py", "batch_invariant")
    assert calls[3][0] == "bench/batch_invariant.py"
    args = bench.parse_args(calls[3][1:])
    assert args.presets == "tiny,llama-3.2-1b" and args.json.parent == results
    # bench/gemv.py imports pycuda at the top (not loadable here): its flags as its parser declares them, and for
    # each preset it runs before that preset's two profiles
    gemv = (ROOT / "bench" / "gemv.py").read_text()
    assert all(f'add_argument("{flag}"' in gemv for flag in ("--invariant", "--runs", "--preset"))
    assert [call[0] for call in calls[4:]] == ["bench/gemv.py", *["bench/profile_step.py"] * 2] * 2
    assert [calls[4], calls[7]] == [["bench/gemv.py", "--invariant", "--runs", "50", "--preset", p]
                                    for p in ("tiny", "llama-3.2-1b")]
    profile = load_script(ROOT / "bench" / "profile_step.py", "profile_step")
    runs = [profile.parse_args(call[1:]) for call in calls[5:7] + calls[8:]]
    assert [(a.dummy_weights, a.batch_invariant) for a in runs] == [("tiny", False), ("tiny", True),
                                                                   ("llama-3.2-1b", False), ("llama-3.2-1b", True)]
    assert all(a.batch == "1" and a.chain for a in runs)
    assert "invariant_device:" in done.stdout
