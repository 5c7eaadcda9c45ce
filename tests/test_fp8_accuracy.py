"""FP8 W8A8 accuracy on the real SmolLM2-135M (the default model's GGUF, dequantized at load, then quantized with
quantization="fp8"): teacher-forced on natural completions, mean |logprob error| of the numpy backend against HF
transformers in float32 on the same weights, next to an ideal torch fake-quant's (weights per channel, activations
per token), with and without the fp8 KV cache."""

import numpy as np
from helpers import require
from test_fp8_weights import fake_quantize, hf_model

from tinyvllm import LLM, SamplingParams
from tinyvllm.model.loader import load_model

torch = require("torch")

PROMPTS = [
    "The capital of France is",
    "Photosynthesis is the process by which plants",
    "Once upon a time, in a small village by the sea,",
    "The three primary colors are",
    "To make a cup of tea, first",
    "The history of the Roman Empire began",
]
COMPLETION_TOKENS = 40


def completion_errors(logprobs: np.ndarray, reference: np.ndarray, starts: list[int]) -> np.ndarray:
    """|logprob error| over each sequence's completion tokens (teacher-forced rows `starts[i]`..)."""
    return np.concatenate([np.abs(a[s:] - b[s:]) for a, b, s in zip(logprobs, reference, starts)])


def test_w8a8_logprob_error_vs_hf_float32(default_model_path):
    model = load_model(default_model_path)
    tokenizer, settings = model.tokenizer, dict(backend="numpy", max_model_len=256, max_num_seqs=8)
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    greedy = LLM(model, **settings).generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(
        temperature=0, max_tokens=COMPLETION_TOKENS, ignore_eos=True), use_tqdm=False)
    texts = [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, greedy)]
    starts = [len(p) - 1 for p in prompts]  # the row predicting the first completion token

    def hf(net) -> list[np.ndarray]:
        with torch.no_grad():
            return [torch.log_softmax(net(torch.tensor([t])).logits[0].double(), -1)[:-1].gather(
                1, torch.tensor(t[1:])[:, None])[:, 0].numpy() for t in texts]

    def ours(**kw) -> list[np.ndarray]:
        outs = LLM(model, **settings, **kw).generate([{"prompt_token_ids": t} for t in texts], SamplingParams(
            max_tokens=1, prompt_logprobs=0), use_tqdm=False)
        return [np.array([d[tok].logprob for d, tok in zip(o.prompt_logprobs[1:], t[1:])]) for o, t in zip(outs, texts)]

    weights = {name: model.weights[name] for name in model.weights}
    exact = hf(hf_model(model.config, weights))
    ideal = completion_errors(hf(fake_quantize(hf_model(model.config, weights))), exact, starts).mean()
    w8a8 = completion_errors(ours(quantization="fp8"), exact, starts).mean()
    with_kv = completion_errors(ours(quantization="fp8", kv_cache_dtype="fp8"), exact, starts).mean()
    float32 = completion_errors(ours(), exact, starts).mean()
    print(f"mean |logprob error| vs HF float32 over {len(texts)} x {COMPLETION_TOKENS} completion tokens: numpy "
          f"float32 {float32:.4f}, ideal fake-quant W8A8 {ideal:.4f}, numpy W8A8 {w8a8:.4f}, W8A8 + fp8 KV cache "
          f"{with_kv:.4f}")
    assert float32 < 0.01  # the reference and the backend agree before quantization
    assert w8a8 <= 0.16 and with_kv <= 0.18, (w8a8, with_kv)
    assert abs(w8a8 - ideal) < 0.25 * ideal  # the twin measures as the ideal quantizer does
