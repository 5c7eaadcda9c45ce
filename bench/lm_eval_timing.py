"""lm-evaluation-harness on tinyvllm against lm-eval's own `hf` model: one multiple-choice task, same model, same run.

The task is tests/eval_tasks/tinyvllm_mc1000 (1,000 synthetic four-choice items, five few-shot examples each, drawn
per item). Each side loads the model (timed apart), then runs lm_eval.simple_evaluate on it: items/s is the task's
items over that run's wall time; "model s" is the part of it spent in the model's loglikelihood(). hf runs first and
frees its GPU memory before tinyvllm takes its KV cache. Both sides compute in bf16 on the GPU (float32 on the CPU);
their per-choice loglikelihoods are compared too, so a fast wrong run shows.

    python bench/lm_eval_timing.py [--device cuda] [--preset llama-3.2-1b | --model PATH] [--items 1000]
                                   [--hf-batch-size 64] [--tinyvllm-args max_num_seqs=512,...] [--json OUT.json]

--preset writes the dummy model (random weights of that model's shapes, tinyvllm.benchmark.dummy_model) as an HF
dir that both sides load, once, to --model-dir. --device cpu runs tinyvllm's numpy backend and hf on the CPU (a
check of this script at tiny scale: --preset tiny --items 20).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import time
from pathlib import Path

TASK = "tinyvllm_mc1000"
TASKS_DIR = Path(__file__).resolve().parent.parent / "tests" / "eval_tasks"
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the model and task are local: never wait on a hub
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import lm_eval  # noqa: E402
import torch  # noqa: E402
from lm_eval.models.huggingface import HFLM  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402
from lm_eval.utils import simple_parse_args_string  # noqa: E402

from tinyvllm.benchmark import dummy_model  # noqa: E402
from tinyvllm.eval.lm_eval_model import TinyvllmLM  # noqa: E402
from tinyvllm.model.dummy import save_hf_model_dir  # noqa: E402


def write_dummy_model(preset: str, path: Path, dtype: str) -> Path:
    """The dummy model as an HF dir at `path`, written once (beside it first, so an interrupted write is not reused)."""
    if path.exists():
        return path
    model = dummy_model(preset)
    partial = path.with_name(path.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    save_hf_model_dir(partial, model.config, model.weights, dtype=dtype)
    partial.rename(path)
    return path


def timed_evaluate(name: str, make_lm, items: int, task_manager: TaskManager) -> tuple[dict, list[dict]]:
    """Load the model, run the task on it; the timings, and the per-item samples."""
    start = time.perf_counter()
    lm = make_lm()
    load_s = time.perf_counter() - start
    model_s = 0.0
    loglikelihood = lm.loglikelihood

    def timed_loglikelihood(*args, **kwargs):  # the model's share of the run (the rest is lm-eval's own work)
        nonlocal model_s
        start = time.perf_counter()
        try:
            return loglikelihood(*args, **kwargs)
        finally:
            model_s += time.perf_counter() - start

    lm.loglikelihood = timed_loglikelihood
    start = time.perf_counter()
    run = lm_eval.simple_evaluate(model=lm, tasks=[TASK], limit=items, task_manager=task_manager, log_samples=True,
                                  verbosity="ERROR")
    eval_s = time.perf_counter() - start
    samples = sorted(run["samples"][TASK], key=lambda s: s["doc_id"])
    if len(samples) != items:
        raise SystemExit(f"{name} scored {len(samples)} items, not {items}")
    result = {"load_s": round(load_s, 2), "eval_s": round(eval_s, 3), "items_per_s": round(items / eval_s, 2),
              "model_s": round(model_s, 3), "model_items_per_s": round(items / model_s, 2),
              "acc": run["results"][TASK]["acc,none"], "acc_norm": run["results"][TASK]["acc_norm,none"]}
    if isinstance(lm, TinyvllmLM) and hasattr(lm.llm.backend, "close"):
        lm.llm.backend.close()  # the cuda backend's device memory, now rather than at garbage collection
    return result, samples


def free_gpu_memory() -> None:
    """Collect the last model (timed_evaluate left it in a reference cycle) and hand torch's cached blocks back to
    the GPU: the next model then finds that memory free (tinyvllm sizes its KV cache from what is free)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def loglikelihoods(samples: list[dict]) -> list[float]:
    return [lp for s in samples for ((lp, _),) in s["resps"]]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--preset", default="llama-3.2-1b", help="dummy model shapes (default llama-3.2-1b)")
    source.add_argument("--model", type=Path, help="an HF model dir instead of a dummy model")
    parser.add_argument("--model-dir", type=Path,
                        help="where --preset's model is written (default /tmp/lm-eval-PRESET-DTYPE)")
    parser.add_argument("--items", type=int, default=1000, help="items of the task to score (at most 1000)")
    parser.add_argument("--hf-batch-size", default="64", help="lm-eval hf's batch_size (a number, or auto)")
    parser.add_argument("--tinyvllm-args", default="", help="more TinyvllmLM/LLM arguments, as lm-eval model_args")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    if not 1 <= args.items <= 1000:
        parser.error("--items must be 1..1000")

    dtype = "bfloat16" if args.device == "cuda" else "float32"
    if args.model is not None:
        model_dir, model_name = args.model, str(args.model)
    else:
        model_dir = args.model_dir or Path(f"/tmp/lm-eval-{args.preset}-{dtype}")
        start = time.perf_counter()
        write_dummy_model(args.preset, model_dir, dtype)
        print(f"model: dummy {args.preset} ({dtype}) at {model_dir}, ready in {time.perf_counter() - start:.1f} s")
        model_name = f"dummy:{args.preset}"
    task_manager = TaskManager(include_path=str(TASKS_DIR))
    hf_batch = args.hf_batch_size if args.hf_batch_size.startswith("auto") else int(args.hf_batch_size)
    backend = "cuda" if args.device == "cuda" else "numpy"
    tinyvllm_args = {"backend": backend, **simple_parse_args_string(args.tinyvllm_args)}

    results = {}
    results["hf"], hf_samples = timed_evaluate(
        "hf", lambda: HFLM(pretrained=str(model_dir), dtype=dtype, device=args.device, batch_size=hf_batch),
        args.items, task_manager)
    free_gpu_memory()
    results["tinyvllm"], our_samples = timed_evaluate(
        "tinyvllm", lambda: TinyvllmLM(str(model_dir), **tinyvllm_args), args.items, task_manager)

    ours, theirs = loglikelihoods(our_samples), loglikelihoods(hf_samples)
    distances = sorted(abs(a - b) for a, b in zip(ours, theirs))
    picks = [max(range(len(s["resps"])), key=lambda i: s["resps"][i][0][0]) for s in our_samples]
    hf_picks = [max(range(len(s["resps"])), key=lambda i: s["resps"][i][0][0]) for s in hf_samples]
    summary = {
        "task": TASK, "items": args.items, "choices": len(ours), "model": model_name, "device": args.device,
        "dtype": dtype, "hf_batch_size": hf_batch, "tinyvllm_args": tinyvllm_args, **results,
        "speedup": round(results["hf"]["eval_s"] / results["tinyvllm"]["eval_s"], 2),  # = the items/s ratio
        "model_speedup": round(results["hf"]["model_s"] / results["tinyvllm"]["model_s"], 2),
        "loglikelihood_abs_diff": {"mean": sum(distances) / len(distances), "median": distances[len(distances) // 2],
                                   "max": distances[-1]},
        "items_picked_differently": sum(a != b for a, b in zip(picks, hf_picks)),
    }
    print(f"\n{TASK}: {args.items} items x 4 choices, {model_name}, {args.device} {dtype}, hf batch_size {hf_batch}")
    print(f"{'':10} {'load s':>8} {'eval s':>8} {'items/s':>9} {'model s':>8} {'items/s':>9} {'acc':>6}")
    for name in ("hf", "tinyvllm"):
        r = results[name]
        print(f"{name:10} {r['load_s']:8.1f} {r['eval_s']:8.1f} {r['items_per_s']:9.2f} {r['model_s']:8.1f} "
              f"{r['model_items_per_s']:9.2f} {r['acc']:6.3f}")
    diff = summary["loglikelihood_abs_diff"]
    print(f"tinyvllm / hf items/s: {summary['speedup']:.2f}x (model time alone: {summary['model_speedup']:.2f}x)")
    print(f"loglikelihoods |tinyvllm - hf|: mean {diff['mean']:.2e},"
          f" max {diff['max']:.2e}; items picked differently: {summary['items_picked_differently']}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(summary, indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main(sys.argv[1:])
