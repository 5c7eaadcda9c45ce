"""HF transformers on the same random weights and prompts: the peers tinyvllm's benchmark is compared with.

Three ways a user would run HF: plain `generate` in static batches, `generate` with the static cache (transformers
then compiles the forward itself: its fastest documented path), and `generate_batch` (paged continuous batching).
Every run generates exactly the planned tokens (EOS disabled), greedy.
"""

from __future__ import annotations

import time

import numpy as np
import torch
import transformers

from tinyvllm.benchmark import Request


def hf_model(loaded, device: str = "cuda", dtype=torch.bfloat16, attn: str = "sdpa"):
    """A LlamaForCausalLM holding the same weights as a tinyvllm LoadedModel."""
    config = transformers.LlamaConfig(**loaded.config.to_hf_dict())
    config.eos_token_id = None  # random weights: never stop early
    config._attn_implementation = attn
    with torch.device(device):
        model = transformers.LlamaForCausalLM(config).to(dtype)
    state = {name: torch.from_numpy(np.ascontiguousarray(w)) for name, w in loaded.weights.items()}
    model.load_state_dict(state, strict=False)  # copies (and casts) into the model's own tensors
    model.tie_weights()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def generate_static_batches(model, requests: list[Request], batch_size: int, static_cache: bool,
                            device: str = "cuda") -> dict:
    """`generate` over batches of equal-length prompts (W1, W3), greedy, exactly max_tokens each."""
    lengths = {len(r.prompt_token_ids) for r in requests} | {r.max_tokens for r in requests}
    if len({len(r.prompt_token_ids) for r in requests}) != 1 or len({r.max_tokens for r in requests}) != 1:
        raise ValueError(f"static HF batches need equal lengths, got {sorted(lengths)}")
    max_tokens = requests[0].max_tokens
    kwargs = dict(max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False)
    if static_cache:
        kwargs["cache_implementation"] = "static"
    batches = [requests[i: i + batch_size] for i in range(0, len(requests), batch_size)]
    with torch.inference_mode():
        warm = torch.tensor([r.prompt_token_ids for r in batches[0]], device=device)
        # Warm up (not timed): the static cache compiles for this exact shape; plain generate needs only a taste.
        model.generate(warm, **(kwargs if static_cache else {**kwargs, "max_new_tokens": 2, "min_new_tokens": 2}))
        _sync(device)
        start = time.perf_counter()
        out_tokens = 0
        for batch in batches:
            ids = torch.tensor([r.prompt_token_ids for r in batch], device=device)
            out = model.generate(ids, **kwargs)
            out_tokens += (out.shape[1] - ids.shape[1]) * out.shape[0]
        _sync(device)
    wall = time.perf_counter() - start
    return {"output_tokens": out_tokens, "wall_s": wall, "output_tok_s": out_tokens / wall}


def generate_batch_paged(model, requests: list[Request], device: str = "cuda") -> dict:
    """`generate_batch`: transformers' continuous batching over a paged cache (needs no_grad, not inference_mode)."""
    max_tokens = max(r.max_tokens for r in requests)
    config = transformers.GenerationConfig(max_new_tokens=max_tokens, do_sample=False, eos_token_id=None,
                                           pad_token_id=0)
    with torch.no_grad():
        _sync(device)
        start = time.perf_counter()
        outputs = model.generate_batch(inputs=[r.prompt_token_ids for r in requests], generation_config=config)
        _sync(device)
    wall = time.perf_counter() - start
    out_tokens = sum(len(o.generated_tokens) for o in outputs.values())
    return {"output_tokens": out_tokens, "wall_s": wall, "output_tok_s": out_tokens / wall}
