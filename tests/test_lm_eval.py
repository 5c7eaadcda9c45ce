"""The `tinyvllm` lm-eval model against lm-eval's own `hf` model on the same tiny random model (CPU, float32): the
test tasks in tests/eval_tasks (multiple choice, generation, rolling perplexity) give the same per-item results."""

import json
import os
from pathlib import Path

import pytest

lm_eval = pytest.importorskip("lm_eval")
pytest.importorskip("accelerate")  # lm-eval's hf model needs it

from click.testing import CliRunner  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

import tinyvllm.eval.lm_eval_model  # noqa: E402,F401  (registers the model)
from tinyvllm import LLM, SamplingParams  # noqa: E402
from tinyvllm.cli import main  # noqa: E402

TASKS_DIR = Path(__file__).parent / "eval_tasks"
TASKS = ["tinyvllm_mc", "tinyvllm_gen", "tinyvllm_rolling"]
pytestmark = pytest.mark.slow


def evaluate(model: str, model_args: str) -> dict:
    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=TASKS, device="cpu", batch_size=1,
                                   task_manager=TaskManager(include_path=str(TASKS_DIR)), log_samples=True,
                                   verbosity="ERROR")


@pytest.fixture(scope="module")
def runs(tiny_model_dir) -> dict:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    return {"hf": evaluate("hf", f"pretrained={tiny_model_dir},dtype=float32"),
            "tinyvllm": evaluate("tinyvllm", f"pretrained={tiny_model_dir},backend=numpy")}


def samples(run: dict, task: str) -> list[dict]:
    return sorted(run["samples"][task], key=lambda s: s["doc_id"])


def test_multiple_choice_loglikelihoods_and_accuracy_equal_hf(runs):
    ours, hf = (samples(runs[m], "tinyvllm_mc") for m in ("tinyvllm", "hf"))
    assert len(ours) == len(hf) == 8
    for a, b in zip(ours, hf):
        assert a["doc"] == b["doc"] and len(a["resps"]) == len(a["doc"]["choices"])
        assert [lp for ((lp, _),) in a["resps"]] == pytest.approx([lp for ((lp, _),) in b["resps"]], abs=1e-3)
        assert [g for ((_, g),) in a["resps"]] == [g for ((_, g),) in b["resps"]]
    for metric in ("acc,none", "acc_norm,none"):
        assert runs["tinyvllm"]["results"]["tinyvllm_mc"][metric] == runs["hf"]["results"]["tinyvllm_mc"][metric]


def test_generate_until_outputs_identical_to_hf(runs, tiny_model_dir):
    ours, hf = (samples(runs[m], "tinyvllm_gen") for m in ("tinyvllm", "hf"))
    assert len(ours) == len(hf) == 6
    assert [s["resps"] for s in ours] == [s["resps"] for s in hf]
    # The stop strings are exercised: some generations end where the unstopped one goes on with "de" or "\n".
    llm = LLM(tiny_model_dir, backend="numpy")
    unstopped = llm.generate([f"Q: {s['doc']['question']}\nA:" for s in ours], SamplingParams(max_tokens=16,
                                                                                              temperature=0))
    full = [llm.tokenizer.decode(out.outputs[0].token_ids, skip_special_tokens=True) for out in unstopped]
    cut = [s["resps"][0][0] for s in ours]
    assert all(f.startswith(c) for f, c in zip(full, cut))
    assert any(f[len(c):].startswith(("de", "\n")) for f, c in zip(full, cut))


def test_rolling_loglikelihoods_equal_hf(runs):
    ours, hf = (samples(runs[m], "tinyvllm_rolling") for m in ("tinyvllm", "hf"))
    assert len(ours) == len(hf) == 6
    assert [s["resps"][0][0] for s in ours] == pytest.approx([s["resps"][0][0] for s in hf], abs=1e-3)


def test_tinyvllm_eval_command_runs_lm_eval(tiny_model_dir, tmp_path):
    result = CliRunner().invoke(main, ["eval", "--model_args", f"pretrained={tiny_model_dir},backend=numpy",
                                       "--tasks", "tinyvllm_mc", "--include_path", str(TASKS_DIR),
                                       "--output_path", str(tmp_path), "--limit", "2"])
    assert result.exit_code == 0, result.output
    written = json.loads(next(tmp_path.rglob("results_*.json")).read_text())
    assert written["config"]["model"] == "tinyvllm" and written["results"]["tinyvllm_mc"]["sample_len"] == 2


def test_tinyvllm_eval_command_bad_model_args_one_line(tiny_model_dir):
    result = CliRunner().invoke(main, ["eval", "--model_args", f"pretrained={tiny_model_dir},tensor_parallel_size=2",
                                       "--tasks", "tinyvllm_mc", "--include_path", str(TASKS_DIR)])
    assert result.exit_code == 1 and "tensor_parallel_size=2 is not supported" in result.output
    assert "Traceback" not in result.output


def test_choices_of_an_item_share_its_context(tiny_model_dir):
    """The loglikelihoods of four choices after one 60-token context: its full blocks are computed once (the choices
    find them in the prefix cache), and the results equal those computed without the cache."""
    from tinyvllm.eval.lm_eval_model import TinyvllmLM

    rng = __import__("numpy").random.default_rng(0)
    context = rng.integers(3, 500, 60).tolist()
    requests = [(None, context, rng.integers(3, 500, n).tolist()) for n in (1, 2, 3, 4)]
    results = {}
    for caching in (True, False):
        model = TinyvllmLM(str(tiny_model_dir), backend="numpy", block_size=4, enable_prefix_caching=caching)
        computed: list[int] = []
        execute = model.llm.backend.execute

        def counting(batch, *args, computed=computed, execute=execute):
            computed.extend(batch.positions.tolist())
            return execute(batch, *args)

        model.llm.backend.execute = counting
        results[caching] = model._loglikelihood_tokens(requests)
        if caching:
            assert computed.count(0) == 1 and computed.count(55) == 1, "the context's full blocks computed once"
            # the context once (60), then per choice its last partial block (56..59) and its own tokens
            assert len(computed) == 60 + sum(4 + len(c) for _, _, c in requests)
        else:
            assert computed.count(0) == len(requests)
    for (a, greedy_a), (b, greedy_b) in zip(results[True], results[False]):
        assert abs(a - b) < 1e-4 and greedy_a == greedy_b
