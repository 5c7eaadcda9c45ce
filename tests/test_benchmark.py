"""The benchmark's workloads and floors on the numpy backend (speed itself is measured by `make bench`, not here)."""

from tinyvllm import LLM
from tinyvllm.benchmark import (dummy_model, floor_seconds, format_results, make_workload, matmul_params,
                                run_benchmark, run_j1, weight_bytes)
from tinyvllm.model.dummy import llama_3_2_1b_config


def test_workload_shapes():
    w1 = make_workload("W1", 1000)
    assert len(w1) == 512 and {len(r.prompt_token_ids) for r in w1} == {256} and {r.max_tokens for r in w1} == {256}
    w2 = make_workload("W2", 1000)
    assert len(w2) == 256 and all(100 <= len(r.prompt_token_ids) <= 1024 and 100 <= r.max_tokens <= 1024 for r in w2)
    w5 = make_workload("W5", 1000)
    assert len(w5) == 1024 and all(r.prompt_token_ids[:1024] == w5[0].prompt_token_ids[:1024] for r in w5)
    assert len({tuple(r.prompt_token_ids[1024:]) for r in w5}) > 1000


def test_llama_1b_floor_matches_the_known_limits():
    config = llama_3_2_1b_config()
    assert abs(weight_bytes(config) / 1e9 - 2.47) < 0.01  # 1.24 B parameters in bf16
    # batch-1 decode is bound by reading the weights: ~0.58 ms per token at 4.27 TB/s
    w3 = make_workload("W3", config.vocab_size)
    per_token = floor_seconds(config, w3, 4.27e12, 7.4e14, 512) / 256
    assert 0.55e-3 < per_token < 0.65e-3
    w5 = make_workload("W5", config.vocab_size)
    assert floor_seconds(config, w5, 4.27e12, 7.4e14, 512, cached_prefix=1024) < \
        floor_seconds(config, w5, 4.27e12, 7.4e14, 512) / 3
    assert matmul_params(config) * 2 * 512 * 256 / 7.4e14 < floor_seconds(config, make_workload("W1", 100), 4.27e12,
                                                                         7.4e14, 512)


def test_run_benchmark_on_the_cpu():
    llm = LLM(dummy_model("tiny"), backend="numpy", max_num_seqs=32)
    results = run_benchmark(llm, ["W1", "W2", "W3", "W4", "W5"], scale=0.02)
    work = results["workloads"]
    assert work["W1"]["output_tokens"] == sum(r.max_tokens for r in make_workload("W1", 1, 0.02))
    assert work["W3"]["ms_per_token"] > 0 and work["W4"]["achieved_tflops"] > 0
    assert work["W5"]["speedup_vs_cache_off"] > 0 and work["W5"]["cache_off"]["output_tokens"] == \
        work["W5"]["output_tokens"]
    assert work["W2"]["unchunked"]["output_tokens"] == work["W2"]["output_tokens"]
    assert all(0 < r["fraction_of_limit"] for r in work.values())
    assert work["W5"]["fraction_of_limit"] < 1, "the floor must count the prefix cache's savings"
    assert llm.llm_engine.block_manager.enable_prefix_caching and llm.llm_engine.scheduler.enable_chunked_prefill
    assert "W5" in format_results(results)


def test_j1_job_and_engine_give_the_same_tokens():
    """J1's plumbing at a tiny scale: the job (text rows through run_job) and the engine (token ids) get the same
    requests and greedy outputs; max_num_seqs 2 keeps the job's in-flight limit (8) below its 20 rows."""
    llm = LLM(dummy_model("tiny", text=True), backend="numpy", max_num_seqs=2)
    result, requests = run_j1(llm, num_rows=20, max_tokens=4, num_words=12, output_token_ids=True)
    assert result["requests"] == len(requests) == 20 and result["same_outputs"] == 20
    assert result["output_tokens"] == result["engine"]["output_tokens"] == 80
    assert result["input_tokens"] == sum(len(r.prompt_token_ids) for r in requests)
    assert result["output_tok_s"] > 0 and result["job_vs_engine"] > 0 and result["finalize_s"] >= 0

