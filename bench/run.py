"""tinyvllm's workloads, the machine's measured limits and HF transformers' peers, in one run.

    python bench/run.py [tinyvllm bench's options] [--peers static,compiled,generate_batch]

`tinyvllm bench` with every workload by default, the results written to out/bench.json with the run's date, host
and commit, and HF's peers: bench/hf_peers.py runs the identical requests on the same weights (W1 and W3: the
workloads HF's static batches can express) in its own process, before tinyvllm loads, so each side has the GPU to
itself; the report gives the ratios of the one run.
"""

from __future__ import annotations

import json
import platform
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import click

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tinyvllm.benchmark import WORKLOADS, format_results, run_benchmark  # noqa: E402
from tinyvllm.cli import bench_llm, bench_options  # noqa: E402

PEERS = ("static", "compiled", "generate_batch")


def run_peers(options: dict, peers: str, batch_sizes: str) -> dict:
    """HF's peers on the same work, in a child process that exits (releasing the GPU) before tinyvllm starts."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "peers.json"
        source = ["--model", str(options["model"])] if options["model"] else ["--dummy-weights",
                                                                              options["dummy_weights"]]
        command = [sys.executable, str(Path(__file__).with_name("hf_peers.py")), "--peers", peers, *source,
                   "--scale", str(options["scale"]), "--seed", str(options["seed"]), "--batch-sizes", batch_sizes,
                   "--json", str(out)]
        done = subprocess.run(command)
        if done.returncode != 0 or not out.exists():
            return {"error": f"bench/hf_peers.py exited with {done.returncode}"}
        return json.loads(out.read_text())


@click.command(help=__doc__)
@bench_options(",".join(WORKLOADS), "out/bench.json")
@click.option("--peers", default="", help=f"comma-separated subset of {','.join(PEERS)}")
@click.option("--peer-batch-sizes", default="256,512", show_default=True, help="HF static batch sizes tried on W1")
def main(peers: str, peer_batch_sizes: str, **options) -> None:
    peer_results = run_peers(options, peers, peer_batch_sizes) if peers else {}
    t0 = time.perf_counter()
    llm = bench_llm(options)
    print(f"loaded {llm.model.source} on {llm.backend.name} in {time.perf_counter() - t0:.1f}s: {llm.info()}",
          flush=True)
    results = run_benchmark(llm, options["workloads"].split(","), options["scale"], options["seed"])
    results["peers"] = peer_results
    results["meta"] = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "host": platform.node(),
                       "commit": _git_commit(), "llm": llm.info(), "scale": options["scale"]}
    print(format_results(results))
    for key, peer in results["peers"].items():
        workload = key.split("/")[0]
        ours = results["workloads"].get(workload, {}).get("output_tok_s")
        if ours and isinstance(peer, dict) and "output_tok_s" in peer:
            batch = f", batch {peer['batch_size']}" if "batch_size" in peer else ""
            print(f"tinyvllm / HF {key}: {ours / peer['output_tok_s']:.2f}x  "
                  f"(HF {peer['output_tok_s']:.0f} tok/s{batch}; same requests)")
    options["json_path"].parent.mkdir(parents=True, exist_ok=True)
    options["json_path"].write_text(json.dumps(results, indent=2, default=str))


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
