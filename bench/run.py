"""`make bench`: tinyvllm's workloads, the machine's measured limits and HF transformers' peers, in one run.

    python bench/run.py [--dummy-weights llama-3.2-1b | --model PATH] [--backend cuda] [--workloads W1,W3]
                        [--scale 1.0] [--peers static,compiled,generate_batch] [--peer-scale 0.5] [--json out.json]

Peers run on the same weights and prompts (W1 and W3: the workloads HF's static batches can express), so the
report gives ratios measured side by side.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tinyvllm import LLM  # noqa: E402
from tinyvllm.benchmark import WORKLOADS, dummy_model, format_results, make_workload, run_benchmark  # noqa: E402
from tinyvllm.model.loader import load_model  # noqa: E402

PEERS = ("static", "compiled", "generate_batch")


def run_peers(model, names: list[str], peer_scale: float, seed: int) -> dict:
    import hf_peers  # torch + transformers: only needed here
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    hf = hf_peers.hf_model(model, device, torch.bfloat16 if device == "cuda" else torch.float32)
    results = {}
    for workload in ("W1", "W3"):
        requests = make_workload(workload, model.config.vocab_size, peer_scale if workload == "W1" else 1.0, seed)
        batch = 256 if workload == "W1" else 1
        for name in names:
            key = f"{workload}/{name}"
            try:
                if name == "generate_batch":
                    if workload == "W3":
                        continue
                    results[key] = hf_peers.generate_batch_paged(hf, requests, device)
                else:
                    results[key] = hf_peers.generate_static_batches(hf, requests, batch, name == "compiled", device)
                if workload == "W3":
                    results[key]["ms_per_token"] = 1000 / results[key]["output_tok_s"]
            except Exception as exc:  # a peer failing is reported, not fatal
                results[key] = {"error": f"{type(exc).__name__}: {exc}"}
            print(f"peer {key}: {results[key]}", flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dummy-weights", default="llama-3.2-1b")
    parser.add_argument("--model", help="a real model instead of dummy weights")
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--max-num-seqs", type=int, default=512)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--peers", default="", help=f"comma-separated subset of {','.join(PEERS)}")
    parser.add_argument("--peer-scale", type=float, default=0.5, help="W1 size for the peers (they are slow)")
    parser.add_argument("--json", default="out/bench.json")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    t0 = time.perf_counter()
    model = load_model(args.model) if args.model else dummy_model(args.dummy_weights, args.seed)
    llm = LLM(model, backend=args.backend, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens,
              max_model_len=min(4096, model.config.max_position_embeddings))
    print(f"loaded {model.source} on {llm.backend.name} in {time.perf_counter() - t0:.1f}s: {llm.info()}", flush=True)
    results = run_benchmark(llm, args.workloads.split(","), args.scale, args.seed)
    results["peers"] = run_peers(model, [p for p in args.peers.split(",") if p], args.peer_scale, args.seed) \
        if args.peers else {}
    results["meta"] = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "host": platform.node(),
                       "commit": _git_commit(), "llm": llm.info(), "scale": args.scale,
                       "peer_scale": args.peer_scale}
    print(format_results(results))
    for key, peer in results["peers"].items():
        workload = key.split("/")[0]
        ours = results["workloads"].get(workload, {}).get("output_tok_s")
        if ours and "output_tok_s" in peer:
            print(f"tinyvllm / HF {key}: {ours / peer['output_tok_s']:.2f}x  "
                  f"(HF {peer['output_tok_s']:.0f} tok/s)")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(results, indent=2, default=str))


def _git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return "unknown"


if __name__ == "__main__":
    main()
