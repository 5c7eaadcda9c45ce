"""End-to-end: `tinyvllm run` over JSONL, Parquet, OpenAI-batch and bad-row inputs with a tiny random model."""

import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from helpers import EXAMPLES, cli, job_args, make_input, ok_run, run

from tinyvllm.benchmark import job_peak_rss
from tinyvllm.cli import main

BASE_COLUMNS = ["row", "id", "prompt", "completion", "finish_reason", "prompt_tokens", "completion_tokens", "error",
                "queue_ms", "ttft_ms", "tpot_ms", "e2e_ms", "finished_at"]
RESULT_COLUMNS = ["chat", "ignored_fields", "structured_output_complete", "cumulative_logprob", "logprobs", "top_logprobs", "prompt_logprobs",
                  "prompt_top_logprobs", "completions", "completions_tokens", "completions_finish_reasons",
                  "completions_cumulative_logprobs"]


def metadata(table: pa.Table) -> dict:
    return {k.decode()[len("tinyvllm."):]: json.loads(v) for k, v in table.schema.metadata.items()
            if k.startswith(b"tinyvllm.")}


def test_run_jsonl(tiny_model_dir, tmp_path):
    out = tmp_path / "prompts.parquet"
    table = ok_run(tiny_model_dir, EXAMPLES / "prompts.jsonl", out, "--max-tokens", "6")
    assert table.schema.names[:len(BASE_COLUMNS)] == BASE_COLUMNS
    assert set(table.schema.names) - set(BASE_COLUMNS) == set(RESULT_COLUMNS) | {"sampling"}
    assert table.column("sampling").null_count == 0  # every row's, asked or not
    assert all(table.column(name).null_count == 16 for name in RESULT_COLUMNS if name != "chat")  # none asked
    assert table.schema.field("id").type == pa.string()
    assert table.schema.field("completion_tokens").type == pa.int32()
    assert table.schema.field("e2e_ms").type == pa.float64()
    ids = [json.loads(line)["id"] for line in (EXAMPLES / "prompts.jsonl").read_text().splitlines()]
    assert table.column("id").to_pylist() == ids  # input order, whatever the finishing order
    rows = table.to_pylist()
    assert all(r["error"] is None and r["finish_reason"] in ("stop", "length") for r in rows)
    assert all(isinstance(r["completion"], str) and r["prompt_tokens"] > 0 for r in rows)
    assert rows[0]["prompt"] == "The capital of France is" and rows[0]["completion_tokens"] <= 6
    assert all(r["e2e_ms"] >= r["ttft_ms"] >= 0 for r in rows)
    meta = metadata(table)
    assert meta["backend"] == "numpy" and meta["batching"] == "continuous" and meta["model"]
    assert meta["sampling"]["max_tokens"] == 6 and meta["version"] and meta["start_time"] <= meta["end_time"]
    counts = meta["counts"]
    assert (counts["rows"], counts["error_rows"], sum(counts["finish_reasons"].values())) == (16, 0, 16)
    assert counts["prompt_tokens"] == sum(r["prompt_tokens"] for r in rows)
    assert counts["output_tokens"] == sum(r["completion_tokens"] for r in rows) and counts["wall_time_s"] > 0
    assert meta["job"]["input_sha256"] and meta["job"]["sampling"]["max_tokens"] == 6
    summary = json.loads((tmp_path / "prompts.summary.json").read_text())
    assert summary["rows"] == 16 and summary["error_rows"] == 0 and summary["latency_ms"]["e2e"]["p50"] > 0


def test_run_parquet_chat_token_ids_logprobs(tiny_model_dir, tmp_path):
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({
        "id": [3, 1, 2],
        "prompt": ["hello there", None, None],
        "messages": [None, [{"role": "user", "content": "hi"}], [{"role": "user", "content": "yo"}]],
        "max_tokens": [5, 3, None],
    }), src)
    table = ok_run(tiny_model_dir, src, tmp_path / "out.parquet", "--output-token-ids", "--logprobs", "2",
                   "--max-tokens", "4", "--temperature", "0")
    rows = table.to_pylist()
    assert [r["id"] for r in rows] == ["3", "1", "2"]
    assert "<|im_start|>user\nhi" in rows[1]["prompt"]  # rendered with the model's chat template
    assert rows[0]["prompt"] == "hello there"
    assert all(1 <= r["completion_tokens"] <= limit for r, limit in zip(rows, [5, 3, 4]))
    for r in rows:
        assert len(r["completion_token_ids"]) == len(r["logprobs"]) == len(r["top_logprobs"]) == r["completion_tokens"]
        assert all(lp <= 0 for lp in r["logprobs"]) and all(2 <= len(top) <= 3 for top in r["top_logprobs"])
        assert r["top_logprobs"][0][0]["logprob"] >= r["top_logprobs"][0][-1]["logprob"]


def test_run_openai_batch(tiny_model_dir, tmp_path):
    table = ok_run(tiny_model_dir, EXAMPLES / "openai_batch.jsonl", tmp_path / "batch.parquet")
    rows = table.to_pylist()
    assert [r["id"] for r in rows] == ["req-1", "req-2", "req-3", "req-4", "req-5"]
    assert [r["finish_reason"] == "error" for r in rows] == [False] * 4 + [True]
    assert "unsupported url '/v1/embeddings'" in rows[4]["error"] and rows[4]["completion"] is None
    assert rows[1]["completion_tokens"] <= 32 and rows[0]["completion_tokens"] <= 16
    assert rows[0]["prompt"].startswith("<|im_start|>system")


def test_run_bad_rows(tiny_model_dir, tmp_path):
    table = ok_run(tiny_model_dir, EXAMPLES / "bad_rows.jsonl", tmp_path / "bad.parquet")
    rows = table.to_pylist()
    assert [r["row"] for r in rows] == list(range(17))
    good = [r for r in rows if r["error"] is None]
    assert [r["id"] for r in good] == ["good-1", "good-2", "good-3"] and all(r["completion"] is not None for r in good)
    bad = [r for r in rows if r["error"] is not None]
    assert len(bad) == 14 and all(r["finish_reason"] == "error" and r["completion"] is None for r in bad)
    assert len({r["error"] for r in bad}) == 14  # each bad row says what is wrong with it
    assert metadata(table)["counts"]["error_rows"] == 14


def test_overlong_prompt_is_an_error_row(tiny_model_dir, tmp_path):
    src = tmp_path / "long.jsonl"
    src.write_text(json.dumps({"id": "long", "prompt": "word " * 200}) + "\n" + json.dumps({"prompt": "short"}) + "\n")
    rows = ok_run(tiny_model_dir, src, tmp_path / "out.parquet", "--max-model-len", "64").to_pylist()
    assert rows[0]["finish_reason"] == "error" and "tokens; the limit is" in rows[0]["error"]
    assert rows[0]["completion"] is None and rows[0]["prompt"] == "word " * 200
    assert rows[0]["prompt_tokens"] > 64  # counted, though not run
    assert rows[1]["finish_reason"] in ("stop", "length")


def test_chat_flag_and_greedy_repeatable(tiny_model_dir, tmp_path):
    args = ("--chat", "--temperature", "0", "--max-tokens", "8", "--max-num-seqs", "3")
    a = ok_run(tiny_model_dir, EXAMPLES / "prompts.jsonl", tmp_path / "a.parquet", *args)
    b = ok_run(tiny_model_dir, EXAMPLES / "prompts.jsonl", tmp_path / "b.parquet", *args, "--batching", "static")
    assert all(p.startswith("<|im_start|>user\n") for p in a.column("prompt").to_pylist())
    assert a.column("completion").to_pylist() == b.column("completion").to_pylist()
    assert metadata(a)["chat"] is True and metadata(b)["batching"] == "static"


@pytest.mark.parametrize("case,args,message", [
    ("missing input", ["--input", "{tmp}/nope.jsonl"], "input not found"),
    ("bad extension", ["--input", "{tmp}/in.txt"], "unsupported input format '.txt'"),
    ("missing model", ["--model", "{tmp}/no-model"], "model not found"),
    ("unknown dummy model", ["--model", "dummy:llama-9b"], "unknown dummy model dummy:llama-9b: choose from"),
    ("unreadable model", ["--model", "{tmp}/in.txt"], "cannot load model"),
    ("output dir is a file", ["--output", "{tmp}/in.txt/out.parquet"], "cannot create output directory"),
    ("bad default", ["--temperature", "-1"], "bad sampling defaults: invalid temperature=-1"),
])
def test_job_level_errors(tiny_model_dir, tmp_path, case, args, message):
    (tmp_path / "in.txt").write_text("hello\n")
    base = {"--model": str(tiny_model_dir), "--input": str(EXAMPLES / "prompts.jsonl"),
            "--output": str(tmp_path / "out.parquet")}
    base.update(dict(zip(args[::2], (a.format(tmp=tmp_path) for a in args[1::2]))))
    result = CliRunner().invoke(main, ["run", "--backend", "numpy", "--quiet", *sum(base.items(), ())])
    assert result.exit_code != 0
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not (tmp_path / "out.parquet").exists()


def test_dummy_model(tmp_path):
    """`--model dummy:PRESET`: random weights, no file; the tokenizer covers the vocabulary, so the text decodes."""
    table = ok_run("dummy:tiny", EXAMPLES / "chat.jsonl", tmp_path / "o.parquet", "--max-tokens", "8",
                   "--ignore-eos", "--output-token-ids")
    assert table.num_rows == 6 and table.column("error").null_count == 6
    assert all(ids and text for ids, text in zip(table.column("completion_token_ids").to_pylist(),
                                                  table.column("completion").to_pylist()))
    assert metadata(table)["model"] == "dummy:tiny" and metadata(table)["job"]["model"] == "dummy:tiny"


def test_no_default_model(tmp_path, monkeypatch):
    monkeypatch.setenv("TINYVLLM_CACHE", str(tmp_path))
    result = CliRunner().invoke(main, ["run", "--input", str(EXAMPLES / "prompts.jsonl"),
                                       "--output", str(tmp_path / "o.parquet")])
    assert result.exit_code != 0 and "tinyvllm fetch-default-model" in result.stderr


def test_python_dash_m(tiny_model_dir, tmp_path):
    out = tmp_path / "o.parquet"
    proc = subprocess.run([sys.executable, "-m", "tinyvllm", "run", "--model", str(tiny_model_dir), "--input",
                           str(EXAMPLES / "chat.jsonl"), "--output", str(out), "--backend", "numpy"],
                          capture_output=True, text=True, cwd=EXAMPLES.parent)
    assert proc.returncode == 0, proc.stderr
    assert "wrote 6 rows (0 errors)" in proc.stderr and pq.read_table(out).num_rows == 6
    evaluate = subprocess.run([sys.executable, str(EXAMPLES / "evaluate.py"), str(out)], capture_output=True, text=True)
    assert evaluate.returncode == 0 and "rows:          6" in evaluate.stdout


# ---- Phase 2: jobs that survive (resume exactly once, locks, signals, job files, hostile input, report) ----

HOSTILE_ERRORS = {  # id -> reason (rows whose id could not be read get their row number)
    "1": "malformed JSON", "num-prompt": "prompt must be a string or a list of token ids, got int",
    "str-tokens": "invalid max_tokens='many'", "empty": "prompt is empty", "no-prompt": "missing prompt or messages",
    "6": "missing prompt or messages", "null-prompt": "missing prompt or messages",
    "neg-tokens": "invalid max_tokens=-10", "huge-tokens": "invalid max_tokens=1000000000000",
    "cold": "invalid temperature=-1", "top-p-zero": "invalid top_p=0", "top-p-big": "invalid top_p=1.01",
    "top-k-neg": "invalid top_k=-5", "nan-temp": "invalid temperature=nan", "float-seed": "invalid seed=1.5",
    "stop-int": "invalid stop=[1]", "too-long": "tokens; the limit is", "18": "invalid UTF-8",
    "19": "unpaired surrogate", "24": "id must be a non-empty string or an integer",
    "dict-prompt": "got dict", "bad-role": "messages[0].role", "oov": "outside the vocabulary",
    "28": "not a JSON object", "29": "nested too deeply",
}


def test_hostile_input(tiny_model_dir, tmp_path):
    rows = ok_run(tiny_model_dir, EXAMPLES / "hostile.jsonl", tmp_path / "h.parquet").to_pylist()
    assert [r["row"] for r in rows] == list(range(31))
    good = {r["id"]: r for r in rows if r["error"] is None}
    assert sorted(good) == ["emoji-cjk", "long-stop", "nul-char", "ok-1", "ok-2"]
    assert all(r["completion"] is not None and r["completion_tokens"] > 0 for r in good.values())
    assert good["emoji-cjk"]["prompt"].startswith("🦙🚀 你好")
    errors = {r["id"]: r["error"] for r in rows if r["error"] is not None and r["row"] != 23}
    assert errors.keys() == HOSTILE_ERRORS.keys()
    for row_id, reason in HOSTILE_ERRORS.items():
        assert reason in errors[row_id], (row_id, errors[row_id])
    assert "duplicate id 'ok-1'" in rows[23]["error"]


def wait_for_pieces(proc, parts: Path, n: int) -> None:
    while proc.poll() is None and len(list(parts.glob("piece-*.parquet"))) < n:
        time.sleep(0.002)
    assert proc.poll() is None, f"finished before {n} pieces: " + proc.communicate()[1]


@pytest.mark.parametrize("kill_points", [[0], [1], [12], [2, 9, 25]], ids=lambda p: "pieces-" + "-".join(map(str, p)))
def test_sigkill_and_resume_exactly_once(tiny_model_dir, reference, tmp_path, kill_points):
    src, ref = reference
    out = tmp_path / "out.parquet"
    parts = Path(str(out) + ".parts")
    for n in kill_points:  # kill -9 once the run has committed n more pieces (0: right after the manifest)
        proc = cli(*job_args(tiny_model_dir, src, out))
        before = len(list(parts.glob("piece-*.parquet")))
        while proc.poll() is None and not (parts / "manifest.json").exists():
            time.sleep(0.002)
        wait_for_pieces(proc, parts, before + n)
        proc.kill()
        proc.wait()
        assert not out.exists() and (parts / "manifest.json").exists()
    assert (parts / "lock").exists()  # left by the killed run, whose flock died with it
    proc = cli(*job_args(tiny_model_dir, src, out))
    assert proc.wait() == 0, proc.communicate()[1]
    table = pq.read_table(out)
    assert table.column("id").to_pylist() == ref.column("id").to_pylist()  # every row exactly once, in order
    assert table.column("completion").to_pylist() == ref.column("completion").to_pylist()
    assert table.column("error").to_pylist() == ref.column("error").to_pylist()
    bad = [i for i in range(ref.num_rows) if i % 10 == 9 or i % 11 == 6]
    assert [i for i, error in enumerate(ref.column("error").to_pylist()) if error is not None] == bad
    assert not parts.exists()


@pytest.mark.parametrize("signum,code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signal_stops_then_resume_checks_manifest(tiny_model_dir, reference, tmp_path, signum, code):
    src, ref = reference
    out = tmp_path / "out.parquet"
    parts = Path(str(out) + ".parts")
    proc = cli(*job_args(tiny_model_dir, src, out))
    wait_for_pieces(proc, parts, 2)
    proc.send_signal(signum)
    _, stderr = proc.communicate()
    assert proc.returncode == code, stderr
    assert f"interrupted by {signal.Signals(signum).name}" in stderr
    assert "run the same command again to resume" in stderr
    assert not out.exists()

    changed = cli(*job_args(tiny_model_dir, src, out), "--temperature", "0.5")
    _, stderr = changed.communicate()
    assert changed.returncode != 0 and "cannot resume" in stderr and "sampling.temperature 1.0 -> 0.5" in stderr

    resumed = cli(*job_args(tiny_model_dir, src, out), "--max-num-seqs", "7")  # scheduling may change
    assert resumed.wait() == 0, resumed.communicate()[1]
    table = pq.read_table(out)
    assert table.column("id").to_pylist() == ref.column("id").to_pylist()
    assert table.column("completion").to_pylist() == ref.column("completion").to_pylist()


def test_resume_refuses_a_changed_input(tiny_model_dir, tmp_path):
    src = make_input(tmp_path / "in.jsonl", 60)
    out = tmp_path / "out.parquet"
    proc = cli(*job_args(tiny_model_dir, src, out))
    wait_for_pieces(proc, Path(str(out) + ".parts"), 1)
    proc.kill()
    proc.wait()
    with open(src, "a") as f:
        f.write(json.dumps({"prompt": "one more"}) + "\n")
    result = run(tiny_model_dir, src, out)
    assert result.exit_code != 0 and "cannot resume" in result.stderr and "input_sha256" in result.stderr
    table = ok_run(tiny_model_dir, src, out, "--overwrite")
    assert table.num_rows == 61


def test_crash_after_final_rename_then_rerun(tiny_model_dir, tmp_path, monkeypatch):
    out = tmp_path / "out.parquet"

    def crash(path):
        raise OSError("simulated crash before the pieces are removed")

    monkeypatch.setattr("tinyvllm.io.writer.clear_parts", crash)
    with pytest.raises(OSError):
        CliRunner().invoke(main, ["run", "--model", tiny_model_dir, "--input", EXAMPLES / "prompts.jsonl",
                                  "--output", out, "--backend", "numpy", "--quiet"], catch_exceptions=False)
    first = pq.read_table(out)
    monkeypatch.undo()
    again = ok_run(tiny_model_dir, EXAMPLES / "prompts.jsonl", out)  # resumes: nothing left but finalizing
    assert again.drop_columns(["finished_at"]).equals(first.drop_columns(["finished_at"]))


def test_lock(tiny_model_dir, tmp_path):
    out = tmp_path / "out.parquet"
    lock = tmp_path / "out.parquet.parts" / "lock"
    lock.parent.mkdir()
    hold = ("import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT); "
            "fcntl.flock(fd, fcntl.LOCK_EX); os.write(fd, f'{os.getpid()} {sys.argv[2]}'.encode()); "
            "print('held', flush=True); time.sleep(60)")
    holder = subprocess.Popen([sys.executable, "-c", hold, str(lock), socket.gethostname()], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        result = run(tiny_model_dir, EXAMPLES / "prompts.jsonl", out)
        assert result.exit_code == 75 and f"is being written by another run (pid {holder.pid} on" in result.stderr
        assert "delete" not in result.stderr and lock.exists() and not out.exists()
    finally:
        holder.kill()
        holder.wait()
    ok_run(tiny_model_dir, EXAMPLES / "prompts.jsonl", out)  # the holder died and the kernel released its lock
    assert not lock.parent.exists()


def write_job(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_job_file(tiny_model_dir, tmp_path, monkeypatch):
    jobs = tmp_path / "project" / "jobs"
    (tmp_path / "project" / "data").mkdir(parents=True)
    (tmp_path / "project" / "data" / "in.jsonl").write_bytes((EXAMPLES / "prompts.jsonl").read_bytes())
    job = write_job(jobs / "small.toml", f"""
model = "{tiny_model_dir}"
input = "../data/in.jsonl"
output = "../out/small.parquet"
backend = "numpy"
max_num_seqs = 4
[sampling]
max_tokens = 5
temperature = 0.0
""")
    monkeypatch.chdir(tmp_path)  # relative paths follow the job file, not the current directory
    out = tmp_path / "project" / "out" / "small.parquet"
    result = CliRunner().invoke(main, ["job", str(job), "--max-tokens", "3"])
    assert result.exit_code == 0, result.output
    table = pq.read_table(out)
    assert table.num_rows == 16 and metadata(table)["sampling"]["max_tokens"] == 3  # the flag wins
    assert metadata(table)["sampling"]["temperature"] == 0.0 and metadata(table)["engine"]["max_num_seqs"] == 4
    assert table.to_pylist()[0]["completion_tokens"] <= 3  # a row without its own max_tokens
    mtime = out.stat().st_mtime_ns

    again = CliRunner().invoke(main, ["job", str(job), "--max-tokens", "3"])
    assert again.exit_code == 0 and "already complete" in again.stderr and "nothing to do" in again.stderr
    assert out.stat().st_mtime_ns == mtime

    changed = CliRunner().invoke(main, ["job", str(job)])
    assert changed.exit_code != 0 and "exists from a different job" in changed.stderr
    assert "sampling.max_tokens 3 -> 5" in changed.stderr
    assert CliRunner().invoke(main, ["job", str(job), "--overwrite"]).exit_code == 0
    assert metadata(pq.read_table(out))["sampling"]["max_tokens"] == 5


@pytest.mark.parametrize("text,message", [
    ('input = "a.jsonl"\noutput = "o.parquet"\nmax_num_seq = 4\n', "unknown key 'max_num_seq'"),
    ('input = "a.jsonl"\noutput = "o.parquet"\nmax_num_seqs = "4"\n', "max_num_seqs = '4' has the wrong type"),
    ('input = "a.jsonl"\noutput = "o.parquet"\n[sampling]\ntemperature = true\n', "sampling.temperature = True"),
    ('input = "a.jsonl"\n[sampling]\nbeam = 2\n', "unknown key 'sampling.beam'"),
    ('input = "a.jsonl"\n', "no output"),
    ('input = "a.jsonl\n', "cannot read job file"),
])
def test_bad_job_files(tmp_path, text, message):
    result = CliRunner().invoke(main, ["job", str(write_job(tmp_path / "j.toml", text))])
    assert result.exit_code != 0 and message in result.stderr and len(result.stderr.strip().splitlines()) == 1
    missing = CliRunner().invoke(main, ["job", str(tmp_path / "nope.toml")])
    assert missing.exit_code != 0 and "job file not found" in missing.stderr


def test_example_job_file_parses():
    from tinyvllm.jobs.file import load_job_file

    cfg = load_job_file(EXAMPLES.parent / "jobs" / "example.toml", {}, {})
    assert cfg.input == EXAMPLES / "prompts.jsonl" and cfg.output == EXAMPLES.parent / "out" / "example.parquet"
    assert cfg.sampling["temperature"] == 0.0 and cfg.model is None


def test_report(tiny_model_dir, tmp_path):
    out = tmp_path / "r.parquet"
    ok_run(tiny_model_dir, EXAMPLES / "prompts.jsonl", out)
    result = CliRunner().invoke(main, ["report", str(out)])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["rows"] == 16 and summary == json.loads((tmp_path / "r.summary.json").read_text())
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "matplotlib is not installed" in result.stderr
    else:
        assert (tmp_path / "r.latency.png").stat().st_size > 0 and (tmp_path / "r.tokens.png").stat().st_size > 0


@pytest.mark.slow
def test_bounded_memory(tiny_model_dir, tmp_path):
    """Peak RSS hardly grows with the input: 10x the rows, about the same memory (not a timing test)."""

    def peak_rss_mib(n: int) -> float:
        rss, _, out = job_peak_rss(tiny_model_dir, n, tmp_path, max_num_seqs=64)
        assert pq.read_metadata(out).num_rows == n
        return rss

    small, large = peak_rss_mib(4_000), peak_rss_mib(40_000)
    assert large < small * 1.25 + 16, (small, large)


def test_prefix_cache_hit_rate_reported_and_switchable(tiny_model_dir, tmp_path):
    shared = "You are a helpful assistant who answers in one short sentence. " * 2
    src = tmp_path / "shared.jsonl"
    src.write_text("".join(json.dumps({"prompt": shared + f"Question {i}?"}) + "\n" for i in range(12)))
    args = ["--temperature", "0", "--max-tokens", "6", "--max-num-seqs", "2", "--max-num-batched-tokens", "64"]
    cached = ok_run(tiny_model_dir, src, tmp_path / "on.parquet", *args)
    plain = ok_run(tiny_model_dir, src, tmp_path / "off.parquet", *args, "--no-prefix-caching",
                   "--no-chunked-prefill")
    on, off = metadata(cached)["engine_stats"], metadata(plain)["engine_stats"]
    assert on["prefix_cache_hit_rate"] > 0.3 and off["prefix_cache_hit_rate"] == 0
    assert json.loads((tmp_path / "on.summary.json").read_text())["engine_stats"] == on
    assert metadata(cached)["engine"]["enable_prefix_caching"] and not metadata(plain)["engine"]["enable_prefix_caching"]
    assert cached.column("completion").to_pylist() == plain.column("completion").to_pylist()


def test_memory_pressure_completes_through_preemption(tiny_model_dir, tmp_path):
    args = ["--temperature", "0", "--max-tokens", "24", "--max-num-seqs", "16"]
    roomy = ok_run(tiny_model_dir, EXAMPLES / "prompts.jsonl", tmp_path / "roomy.parquet", *args)
    tight = ok_run(tiny_model_dir, EXAMPLES / "prompts.jsonl", tmp_path / "tight.parquet", *args,
                   "--num-kv-blocks", "40", "--block-size", "4")
    assert metadata(tight)["engine_stats"]["num_preemptions"] > 0, "the cache was meant to be far too small"
    assert metadata(roomy)["engine_stats"]["num_preemptions"] == 0
    assert tight.column("error").null_count == tight.num_rows
    assert tight.column("completion").to_pylist() == roomy.column("completion").to_pylist()


def test_every_setting_has_a_flag_and_a_job_file_key():
    """A setting is added in one place (EngineConfig / JobConfig / RayConfig) and reaches the CLI and job files."""
    import dataclasses

    from tinyvllm.config import EngineConfig
    from tinyvllm.jobs.config import JobConfig, RayConfig
    from tinyvllm.jobs.file import JOB_FILE_KEYS

    params = {p.name for p in main.commands["run"].params} & {p.name for p in main.commands["job"].params}
    for cls, prefix in ((EngineConfig, ""), (JobConfig, ""), (RayConfig, "ray.")):
        for f in dataclasses.fields(cls):
            if "help" in f.metadata:
                assert f.name in params, f"no flag for {f.name}"
                assert prefix + f.name in JOB_FILE_KEYS, f"no job-file key for {f.name}"
    assert {f.name for f in dataclasses.fields(EngineConfig)} <= params


@pytest.mark.parametrize("text,message", [
    ("max_in_flight = -1", "invalid max_in_flight=-1: must be >= 1"),
    ("num_kv_blocks = 1000000000000", "invalid num_kv_blocks=1000000000000: must be <="),
    ("seed = -1", "invalid seed=-1: must be >= 0"),
    ('backend = "tpu"', "invalid backend='tpu': choose auto, numpy, cuda"),
    ("cpu_kv_cache_gib = 0", "invalid cpu_kv_cache_gib=0.0: must be > 0.0"),
])
def test_job_files_are_checked_like_flags(tmp_path, text, message):
    job = write_job(tmp_path / "j.toml", f'input = "a.jsonl"\noutput = "o.parquet"\n{text}\n')
    result = CliRunner().invoke(main, ["job", str(job)])
    assert result.exit_code != 0 and message in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_cpu_kv_cache_gib_reaches_the_engine(tiny_model_dir, tmp_path):
    out = tmp_path / "o.parquet"
    result = CliRunner().invoke(main, ["run", "--input", str(EXAMPLES / "prompts.jsonl"), "--output", str(out),
                                       "--model", str(tiny_model_dir), "--backend", "numpy", "--max-tokens", "2",
                                       "--cpu-kv-cache-gib", "0.001", "--quiet"])
    assert result.exit_code == 0, result.output
    engine = json.loads(pq.read_schema(out).metadata[b"tinyvllm.engine"])
    assert engine["cpu_kv_cache_gib"] == 0.001 and engine["num_kv_blocks"] < 1000


def test_a_setting_the_model_cannot_meet_is_a_settings_error(tiny_model_dir, tmp_path):
    result = CliRunner().invoke(main, ["run", "--input", str(EXAMPLES / "prompts.jsonl"), "--output",
                                       str(tmp_path / "o.parquet"), "--model", str(tiny_model_dir), "--backend",
                                       "numpy", "--max-model-len", "100000", "--quiet"])
    assert result.exit_code != 0 and len(result.stderr.strip().splitlines()) == 1
    assert "invalid max_model_len=100000: the model supports up to" in result.stderr
    assert "cannot load model" not in result.stderr


def test_sampling_defaults_from_flags_and_job_files_equal_the_api(tiny_model_dir, tmp_path):
    """vLLM's sampling fields as job-wide defaults: the same completions from flags, a job file and LLM.generate."""
    from tinyvllm import LLM, SamplingParams

    src = tmp_path / "in.jsonl"
    prompts = ["Hello there", "The quick brown fox"]
    src.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    fields = dict(max_tokens=6, temperature=0.8, seed=3, n=2, presence_penalty=0.5, frequency_penalty=0.3,
                  repetition_penalty=1.2, min_tokens=2, ignore_eos=True, logit_bias={"77": 2.5},
                  bad_words=["zz"], stop_token_ids=[5])
    flags = ["--max-tokens", "6", "--temperature", "0.8", "--n", "2", "--presence-penalty", "0.5",
             "--frequency-penalty", "0.3", "--repetition-penalty", "1.2", "--min-tokens", "2", "--ignore-eos",
             "--logit-bias", '{"77": 2.5}', "--bad-words", "zz", "--stop-token-ids", "5"]
    from_flags = ok_run(tiny_model_dir, src, tmp_path / "flags.parquet", *flags)
    job = write_job(tmp_path / "j.toml", f'input = "in.jsonl"\noutput = "job.parquet"\nmodel = "{tiny_model_dir}"\n'
                    'backend = "numpy"\nquiet = true\n[sampling]\nmax_tokens = 6\ntemperature = 0.8\nn = 2\n'
                    'presence_penalty = 0.5\nfrequency_penalty = 0.3\nrepetition_penalty = 1.2\nmin_tokens = 2\n'
                    'ignore_eos = true\nlogit_bias = {"77" = 2.5}\nbad_words = ["zz"]\nstop_token_ids = [5]\n')
    result = CliRunner().invoke(main, ["job", str(job)])
    assert result.exit_code == 0, result.output
    from_file = pq.read_table(tmp_path / "job.parquet")
    assert from_flags.column("completions").to_pylist() == from_file.column("completions").to_pylist()
    meta = metadata(from_flags)["sampling"]
    assert meta["n"] == 2 and meta["presence_penalty"] == 0.5 and meta["logit_bias"] == {"77": 2.5}
    # The job seeds each row from the job seed and its row number; the API gets those seeds explicitly.
    from tinyvllm.jobs.run import _row_seed

    llm = LLM(tiny_model_dir, backend="numpy")
    api = [llm.generate(p, SamplingParams(**{**fields, "seed": _row_seed(0, i)}))[0] for i, p in enumerate(prompts)]
    assert from_flags.column("completions").to_pylist() == [[c.text for c in o.outputs] for o in api]
