"""The real default model (SmolLM2-135M-Instruct, Q4_1 GGUF) through the whole engine on the CPU."""

from tinyvllm import LLM, SamplingParams


def test_smollm2_knows_the_capital_of_france(default_model_path):
    llm = LLM(default_model_path, backend="numpy", max_num_seqs=4)
    out = llm.chat([[{"role": "user", "content": "What is the capital of France?"}]],
                   SamplingParams(max_tokens=40, temperature=0))[0]
    assert out.error is None
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"  # it ends with <|im_end|>, not by running out of tokens


def test_smollm2_batched_greedy_equals_alone(default_model_path):
    questions = ["What is 2 + 2?", "Name a color.", "What is the capital of Italy?"]
    params = SamplingParams(max_tokens=16, temperature=0)
    llm = LLM(default_model_path, backend="numpy", max_num_seqs=4)
    together = llm.chat([[{"role": "user", "content": q}] for q in questions], params)
    alone = [llm.chat([[{"role": "user", "content": q}]], params)[0] for q in questions]
    assert [o.outputs[0].token_ids for o in together] == [o.outputs[0].token_ids for o in alone]
