"""`make bench`: tinyvllm's workloads, the machine's measured limits and HF transformers' peers, in one run.

    python bench/run.py [--dummy-weights llama-3.2-1b | --model PATH] [--backend cuda] [--workloads W1,W3,J1]
                        [--scale 1.0] [--peers static,compiled,generate_batch] [--json out.json]

Peers (bench/hf_peers.py) run the identical requests on the same weights (W1 and W3: the workloads HF's static
batches can express) in their own process, before tinyvllm loads, so each side has the GPU to itself; the report
gives the ratios of the one run.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tinyvllm import LLM  # noqa: E402
from tinyvllm.benchmark import WORKLOADS, dummy_model, format_results, run_benchmark  # noqa: E402
from tinyvllm.model.loader import load_model  # noqa: E402

PEERS = ("static", "compiled", "generate_batch")


def run_peers(args) -> dict:
    """HF's peers on the same work, in a child process that exits (releasing the GPU) before tinyvllm starts."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "peers.json"
        source = ["--model", args.model] if args.model else ["--dummy-weights", args.dummy_weights]
        command = [sys.executable, str(Path(__file__).with_name("hf_peers.py")), "--peers", args.peers, *source,
                   "--scale", str(args.scale), "--seed", str(args.seed), "--batch-sizes", args.peer_batch_sizes,
                   "--json", str(out)]
        done = subprocess.run(command)
        if done.returncode != 0 or not out.exists():
            return {"error": f"bench/hf_peers.py exited with {done.returncode}"}
        return json.loads(out.read_text())


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
    parser.add_argument("--peer-batch-sizes", default="256,512", help="HF static batch sizes tried on W1")
    parser.add_argument("--json", default="out/bench.json")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    peers = run_peers(args) if args.peers else {}
    t0 = time.perf_counter()
    # J1 decodes the text of every generated id: dummy weights get a tokenizer covering their vocabulary
    model = load_model(args.model) if args.model else dummy_model(args.dummy_weights, args.seed,
                                                                  text="J1" in args.workloads.split(","))
    llm = LLM(model, backend=args.backend, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens,
              max_model_len=min(4096, model.config.max_position_embeddings))
    print(f"loaded {model.source} on {llm.backend.name} in {time.perf_counter() - t0:.1f}s: {llm.info()}", flush=True)
    results = run_benchmark(llm, args.workloads.split(","), args.scale, args.seed)
    results["peers"] = peers
    results["meta"] = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "host": platform.node(),
                       "commit": _git_commit(), "llm": llm.info(), "scale": args.scale}
    print(format_results(results))
    for key, peer in results["peers"].items():
        workload = key.split("/")[0]
        ours = results["workloads"].get(workload, {}).get("output_tok_s")
        if ours and isinstance(peer, dict) and "output_tok_s" in peer:
            batch = f", batch {peer['batch_size']}" if "batch_size" in peer else ""
            print(f"tinyvllm / HF {key}: {ours / peer['output_tok_s']:.2f}x  "
                  f"(HF {peer['output_tok_s']:.0f} tok/s{batch}; same requests)")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(results, indent=2, default=str))


def _git_commit(repo: Path = Path(__file__).resolve().parent.parent) -> str:
    """HEAD's short hash, with "-dirty" when tracked files differ from it: the numbers then came from other code
    (a copy of the tree whose git metadata is older than its files, say)."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True, text=True)
        if head.returncode:
            return "unknown"
        differs = subprocess.run(["git", "diff", "--quiet", "HEAD", "--"], cwd=repo, capture_output=True).returncode
        return head.stdout.strip() + ("-dirty" if differs else "")
    except OSError:
        return "unknown"


if __name__ == "__main__":
    main()
