"""HF transformers on the same random weights and the identical requests: the peers tinyvllm's benchmark races.

Three ways a user would run HF: plain `generate` in static batches, `generate` with the static cache (transformers
then compiles the forward itself: its fastest documented path), and `generate_batch` (paged continuous batching).
Every run generates exactly the planned tokens (EOS disabled), greedy.

bench/run.py runs this file as its own process before tinyvllm loads, so each side has the GPU to itself:

    python bench/hf_peers.py --peers static,compiled,generate_batch [--dummy-weights NAME | --model PATH]
                             [--scale 1.0] [--seed 0] [--batch-sizes 256,512] [--workloads W1,W3] --json peers.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
import transformers

from tinyvllm.benchmark import Request, dummy_model, make_workload
from tinyvllm.model.dummy import RandomBf16Weights, RandomRecipe
from tinyvllm.model.loader import load_model

PEERS = ("static", "compiled", "generate_batch")


def hf_model(loaded, device: str = "cuda", dtype=torch.bfloat16, attn: str = "sdpa"):
    """The HF transformers model of the LoadedModel's family (Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma 2 and 3,
    Mixtral, Qwen3-MoE, OLMoE) holding its weights.

    Built in `dtype` directly on `device` without HF's random init (no_init_weights: its parameters are allocated,
    not filled, so a 30B MoE is built in seconds), and each weight is copied in as stored (bf16 bit patterns for a
    bf16 checkpoint), one tensor at a time: no float32 copy and no host copy of the whole model; dummy weights in
    bf16 are made on `device` (random_bf16: the bits RandomBf16Weights.stored makes, as the cuda backend makes
    them). transformers>=5 holds a layer's experts fused (experts.gate_up_proj [E, 2I, hidden], experts.down_proj),
    filled expert by expert (_hf_tensors)."""
    hf_dict = loaded.config.to_hf_dict() | {"pad_token_id": 0}  # Phi-3's default (32000) is past a small vocabulary
    config = transformers.AutoConfig.for_model(hf_dict.pop("model_type"), **hf_dict)
    config.eos_token_id = None  # random weights: never stop early
    # HF's sdpa attention has no soft cap: Gemma 2 runs eager (as HF picks for it)
    config._attn_implementation = "eager" if loaded.config.attn_logit_softcapping else attn
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # as from_pretrained(dtype=...) does: parameters made in dtype, not cast later
    try:
        with torch.device(device), _no_init_weights():
            model = getattr(transformers, loaded.config.architecture)(config)
    finally:
        torch.set_default_dtype(default_dtype)
    if loaded.config.tie_word_embeddings:  # transformers 5.17 ties at from_pretrained only, 5.24 also here
        model.get_output_embeddings().weight = model.get_input_embeddings().weight
    params = dict(model.named_parameters())  # a tied head is the embedding: listed once
    tensors = _hf_tensors(loaded, params)
    if set(params) != set(tensors):
        raise ValueError(f"HF {loaded.config.architecture} and tinyvllm disagree on the tensors: "
                         f"{sorted(set(params) ^ set(tensors))[:5]}")
    read = _reader(loaded.weights, device, dtype)
    with torch.no_grad():
        for name, param in params.items():
            rows = param.view(-1, param.shape[-1]) if param.dim() > 1 else param.view(1, -1)
            start = 0
            for part in tensors[name]:  # to the device, cast to dtype if stored otherwise
                value = read(part).reshape(-1, rows.shape[-1])
                rows[start:start + len(value)].copy_(value)
                start += len(value)
            if start != len(rows):
                raise ValueError(f"HF's {name} {tuple(param.shape)} is not the tensors it stacks: {tensors[name][:2]}")
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()


def _no_init_weights():
    """transformers' context in which a model's constructor allocates its parameters without initializing them."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # transformers < 5
        from transformers.modeling_utils import no_init_weights
    return no_init_weights()


def _hf_tensors(loaded, params: dict) -> dict[str, list[str]]:
    """HF parameter name -> our tensors it holds, in its row order: one each, but a fused expert parameter of
    transformers>=5 (every expert's gate then up rows; or every expert's down rows), and Mixtral's
    block_sparse_moe named mlp there."""
    from tinyvllm.model.layout import expert_names, layout_of, present

    cfg = loaded.config
    layout = layout_of(cfg)

    def hf_name(name: str) -> str:
        return name if name in params else name.replace(".block_sparse_moe.", ".mlp.")

    out: dict[str, list[str]] = {}
    for i in range(cfg.num_hidden_layers):
        prefix = layout.hf_layer.format(i=i)
        for p in layout.layer:
            if p.experts and present(p, cfg, i):
                fused = hf_name(f"{prefix}{p.parts[0].hf.partition('.experts.')[0]}.experts."
                                f"{'gate_up_proj' if len(p.parts) == 2 else 'down_proj'}")
                if fused in params:
                    out[fused] = expert_names(p, prefix, cfg)
    covered = {part for parts in out.values() for part in parts}
    for name in loaded.weights:
        if name not in covered and not (name == "lm_head.weight" and cfg.tie_word_embeddings):
            out[hf_name(name)] = [name]
    return out


def _reader(weights, device: str, dtype):
    """name -> the tensor as stored (bf16 bit patterns as torch.bfloat16); dummy weights in bf16 made on `device`."""
    if isinstance(weights, RandomBf16Weights) and dtype == torch.bfloat16:
        return lambda name: random_bf16(weights.recipe(name), device)
    stored = getattr(weights, "stored", weights.__getitem__)
    return lambda name: _as_torch(stored(name))


def _lowbias32(x: torch.Tensor) -> torch.Tensor:
    """dummy.lowbias32 on int64 tensors holding uint32 values (products wrap; their low 32 bits are kept)."""
    mask = 0xFFFFFFFF
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & mask
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & mask
    return x ^ (x >> 16)


def random_bf16(recipe: RandomRecipe, device: str, chunk: int = 1 << 26) -> torch.Tensor:
    """A RandomBf16Weights tensor (its recipe) made on `device` by torch: bf16 [size], the bits stored() makes."""
    table = _as_torch(recipe.table).to(device)
    out = torch.empty(recipe.size, dtype=torch.bfloat16, device=device)
    for start in range(0, recipe.size, chunk):
        x = torch.arange(start, min(start + chunk, recipe.size), dtype=torch.int64, device=device)
        x = _lowbias32(_lowbias32((x + recipe.k1) & 0xFFFFFFFF) ^ recipe.k2)
        out[start:start + len(x)] = table[x >> 16]
    return out


def _as_torch(array: np.ndarray) -> torch.Tensor:
    """A host tensor sharing the array's memory; bfloat16 bit patterns (uint16) as torch.bfloat16."""
    array = np.ascontiguousarray(array)
    if array.dtype == np.uint16:
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


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


def run_peers(model, names: list[str], scale: float, seed: int, batch_sizes: list[int],
              workloads: tuple[str, ...] = ("W1", "W3"), json_path: Path | None = None) -> dict:
    """W1 and W3 (or those of `workloads`), exactly as tinyvllm's benchmark makes them, through each HF peer. W1's
    static batches run at each of batch_sizes and the fastest is reported (with the batch size it used). The
    results so far are written to json_path after each peer (a run cut short keeps them)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    start = time.perf_counter()
    hf = hf_model(model, device, torch.bfloat16 if device == "cuda" else torch.float32)
    print(f"HF {model.config.architecture} built on {device} in {time.perf_counter() - start:.1f} s", flush=True)
    results = {}
    for workload in workloads:
        requests = make_workload(workload, model.config.vocab_size, scale, seed)
        for name in names:
            key = f"{workload}/{name}"
            try:
                if name == "generate_batch":
                    if workload == "W3":
                        continue
                    results[key] = generate_batch_paged(hf, requests, device)
                else:
                    tries = []
                    for batch in (batch_sizes if workload == "W1" else [1]):
                        tries.append({**generate_static_batches(hf, requests, batch, name == "compiled", device),
                                      "batch_size": batch})
                        print(f"peer {key} batch {batch}: {tries[-1]}", flush=True)
                    results[key] = max(tries, key=lambda r: r["output_tok_s"])
                if workload == "W3":
                    results[key]["ms_per_token"] = 1000 / results[key]["output_tok_s"]
            except Exception as exc:  # a peer failing (e.g. out of memory) is reported, not fatal
                results[key] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
                if device == "cuda":
                    torch.cuda.empty_cache()
            print(f"peer {key}: {results[key]}", flush=True)
            if json_path is not None:
                json_path.write_text(json.dumps(results, indent=2))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", default=",".join(PEERS))
    parser.add_argument("--dummy-weights", default="llama-3.2-1b")
    parser.add_argument("--model")
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-sizes", default="256,512", help="W1 static batch sizes to try")
    parser.add_argument("--workloads", default="W1,W3", help="W1, W3 or both")
    parser.add_argument("--json", required=True)
    args = parser.parse_args()
    model = load_model(args.model) if args.model else dummy_model(args.dummy_weights, args.seed)
    results = run_peers(model, [p for p in args.peers.split(",") if p], args.scale, args.seed,
                        [int(b) for b in args.batch_sizes.split(",")], tuple(args.workloads.split(",")),
                        Path(args.json))
    Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    main()
