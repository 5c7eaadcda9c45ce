"""The fp8 KV cache on the GPU: W1 and W2 with `--kv-cache-dtype fp8` beside the bf16 cache (same process, same
limits), the KV blocks each fits, and the accuracy cost against HF transformers in float32 on the same weights:
prompt logprob error and greedy agreement, for the bf16 and the fp8 cache.

    python bench/fp8_kv.py OUT_DIR [--dummy-weights llama-3.2-1b] [--scale 1.0]

Writes OUT_DIR/fp8_kv.json and prints a summary (~2-3 minutes on an H200).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from hf_peers import hf_model  # noqa: E402
from tinyvllm import LLM, SamplingParams  # noqa: E402
from tinyvllm.benchmark import dummy_model, format_results, measure_limits, run_benchmark  # noqa: E402
from tinyvllm.model.dtypes import bf16_to_f32, f32_to_bf16  # noqa: E402
from tinyvllm.model.loader import LoadedModel  # noqa: E402

PROMPTS, PROMPT_LEN, GREEDY_TOKENS = 16, 512, 64


def hf_reference(loaded, prompts: list[list[int]]) -> tuple[list[np.ndarray], list[list[int]]]:
    """HF float32's logprob of each prompt token (from the second on) and its greedy continuation."""
    model = hf_model(loaded, dtype=torch.float32)
    logprobs, greedy = [], []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt], device="cuda")
            lp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
            logprobs.append(lp.gather(1, ids[0, 1:, None])[:, 0].cpu().numpy())
            out = model.generate(ids, max_new_tokens=GREEDY_TOKENS, min_new_tokens=GREEDY_TOKENS, do_sample=False)
            greedy.append(out[0, len(prompt):].tolist())
    del model
    torch.cuda.empty_cache()
    return logprobs, greedy


def accuracy(llm: LLM, prompts, ref_logprobs, ref_greedy) -> dict:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=GREEDY_TOKENS, prompt_logprobs=0, ignore_eos=True,
                                       detokenize=False),
                        use_tqdm=False)
    errors = np.concatenate([np.array([d[t].logprob for d, t in zip(o.prompt_logprobs[1:], p[1:])]) - ref
                             for o, p, ref in zip(outs, prompts, ref_logprobs)])
    agreed = [next((i for i, (a, b) in enumerate(zip(o.outputs[0].token_ids, want)) if a != b), len(want))
              for o, want in zip(outs, ref_greedy)]
    return {"prompt_logprob_abs_err_mean": float(np.abs(errors).mean()),
            "prompt_logprob_abs_err_p99": float(np.quantile(np.abs(errors), 0.99)),
            "prompt_logprob_abs_err_max": float(np.abs(errors).max()),
            "greedy_tokens_agreed_before_divergence": int(sum(agreed)), "greedy_tokens": GREEDY_TOKENS * len(prompts),
            "greedy_sequences_identical": int(sum(a == GREEDY_TOKENS for a in agreed))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--dummy-weights", default="llama-3.2-1b")
    parser.add_argument("--scale", type=float, default=1.0)
    args = parser.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    loaded = dummy_model(args.dummy_weights)
    # every side computes with the same (bf16-representable) weights
    weights = {name: bf16_to_f32(f32_to_bf16(w)) for name, w in loaded.weights.items()}
    loaded = LoadedModel(loaded.config, weights, loaded.tokenizer, loaded.source)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, loaded.config.vocab_size, PROMPT_LEN).tolist() for _ in range(PROMPTS)]
    ref_logprobs, ref_greedy = hf_reference(loaded, prompts)

    report, limits = {}, None
    for kv_cache_dtype in ("auto", "fp8"):
        llm = LLM(loaded, backend="cuda", kv_cache_dtype=kv_cache_dtype, max_num_seqs=512,
                  max_num_batched_tokens=8192, max_model_len=min(4096, loaded.config.max_position_embeddings))
        limits = limits or measure_limits(llm.backend)
        results = run_benchmark(llm, ["W1", "W2"], args.scale, limits=limits)
        report[kv_cache_dtype] = {"backend": llm.backend.describe(), "kv_blocks": llm.llm_engine.num_kv_blocks,
                                  "benchmark": results,
                                  "accuracy_vs_hf_fp32": accuracy(llm, prompts, ref_logprobs, ref_greedy)}
        print(f"== kv_cache_dtype={kv_cache_dtype}: {llm.backend.describe()}")
        print(format_results(results))
        print(json.dumps(report[kv_cache_dtype]["accuracy_vs_hf_fp32"]))
        llm.backend.close()
        del llm
        gc.collect()
    (args.out_dir / "fp8_kv.json").write_text(json.dumps(report, indent=2, default=str))
    blocks = {k: v["kv_blocks"] for k, v in report.items()}
    print(f"KV blocks: bf16 {blocks['auto']}, fp8 {blocks['fp8']} ({blocks['fp8'] / blocks['auto']:.2f}x)")


if __name__ == "__main__":
    main()
