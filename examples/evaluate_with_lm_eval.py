"""Evaluate a model with lm-evaluation-harness on tinyvllm (`pip install 'tinyvllm[eval]'`).

    python examples/evaluate_with_lm_eval.py [MODEL] [--tasks hellaswag,arc_easy] [--limit N] [--backend numpy]

MODEL is an HF model dir or a .gguf file (default: the fetched default model). Without --tasks it runs the small
local tasks in tests/eval_tasks, which need no download. The same from the shell:

    tinyvllm eval --model_args pretrained=MODEL,backend=numpy --tasks tinyvllm_mc --include_path tests/eval_tasks
"""

import argparse
from pathlib import Path

import lm_eval
from lm_eval.tasks import TaskManager
from lm_eval.utils import make_table

import tinyvllm.eval.lm_eval_model  # noqa: F401  (registers the "tinyvllm" model with lm-eval)
from tinyvllm.fetch import fetch_default_model

LOCAL_TASKS = Path(__file__).resolve().parent.parent / "tests" / "eval_tasks"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", help="HF model dir or .gguf [default: the fetched default model]")
    parser.add_argument("--tasks", default="tinyvllm_mc,tinyvllm_gen,tinyvllm_rolling")
    parser.add_argument("--limit", type=int, help="items per task")
    parser.add_argument("--backend", default="auto", choices=["auto", "numpy", "cuda"])
    args = parser.parse_args()
    model = args.model or fetch_default_model()
    # Every LLM keyword argument may go in model_args: max_num_seqs, max_model_len, dtype, enforce_eager, ...
    results = lm_eval.simple_evaluate(model="tinyvllm", model_args={"pretrained": str(model), "backend": args.backend},
                                      tasks=args.tasks.split(","), limit=args.limit,
                                      task_manager=TaskManager(include_path=str(LOCAL_TASKS)))
    print(make_table(results))


if __name__ == "__main__":
    main()
