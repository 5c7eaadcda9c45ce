"""Issue 13: structured outputs (JSON schema, regex, choice, grammar) enforced token by token through llguidance, on
the numpy backend; the mask's numpy twin; the request surface (SamplingParams, rows, response_format, CLI, job files).
The cuda kernel is checked against the twin in tests/gpu/test_token_bitmask.py."""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from helpers import llm_for

from tinyvllm import LLM, SamplingParams
from tinyvllm.backends.sampler import apply_token_bitmask
from tinyvllm.cli import main
from tinyvllm.io.readers import BadRow, parse_request
from tinyvllm.sampling_params import StructuredOutputsParams

llguidance = pytest.importorskip("llguidance")

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


# ---- the mask -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("vocab", [32, 100, 517])
def test_apply_token_bitmask_matches_llguidance_reference(vocab):
    """The twin of the cuda kernel against llguidance's own numpy mask application, on fresh random masks."""
    from llguidance.numpy import apply_token_bitmask_inplace

    rng = np.random.default_rng(vocab)
    rows = np.array([1, -1, 0, 2, -1], np.int32)
    bitmask = rng.integers(-2**31, 2**31, size=(3, (vocab + 31) // 32), dtype=np.int64).astype(np.int32)
    logits = rng.standard_normal((len(rows), vocab)).astype(np.float32)
    ours = logits.copy()
    apply_token_bitmask(ours, bitmask, rows)
    for i, r in enumerate(rows):
        expected = logits[i:i + 1].copy()
        if r >= 0:
            apply_token_bitmask_inplace(expected, bitmask[r:r + 1])
        np.testing.assert_array_equal(ours[i], expected[0])
    assert np.isinf(ours[rows >= 0]).any() and not np.isinf(ours[rows < 0]).any()


# ---- SamplingParams and rows ----------------------------------------------------------------------------------------

def test_structured_outputs_params_are_checked():
    assert SamplingParams(structured_outputs={"regex": "a+"}).structured_outputs == StructuredOutputsParams(regex="a+")
    assert StructuredOutputsParams.from_value('{"choice": ["x", "y"]}').choice == ["x", "y"]
    for bad, why in [({}, "exactly one"), ({"regex": "a", "choice": ["a"]}, "exactly one"),
                     ({"choice": []}, "choice"), ({"choice": "a,b"}, "choice"), ({"json": 3}, "json"),
                     ({"regex": "a", "whatever": 1}, "unknown"), ("not json", "object"),
                     ({"json_object": "yes"}, "true or false")]:
        with pytest.raises(ValueError, match=why):
            SamplingParams(structured_outputs=bad)
    # the same constraint written differently compiles once
    assert (StructuredOutputsParams(json={"b": 1, "a": 2}).key() == StructuredOutputsParams(json={"a": 2, "b": 1}).key())


def test_rows_name_constraints_as_openai_and_vllm_do():
    schema_format = {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON, "strict": True}}
    assert parse_request({"prompt": "x", "response_format": schema_format}).overrides["structured_outputs"] == \
        {"json": PERSON}
    assert parse_request({"prompt": "x", "response_format": {"type": "json_object"}}).overrides[
        "structured_outputs"] == {"json_object": True}
    assert "structured_outputs" not in parse_request({"prompt": "x", "response_format": {"type": "text"}}).overrides
    assert parse_request({"prompt": "x", "response_format": json.dumps(schema_format)}).overrides[
        "structured_outputs"] == {"json": PERSON}  # a Parquet string column
    assert parse_request({"prompt": "x", "guided_choice": ["a", "b"]}).overrides["structured_outputs"] == \
        {"choice": ["a", "b"]}
    assert parse_request({"prompt": "x", "structured_outputs": {"regex": "[0-9]+"}}).overrides[
        "structured_outputs"] == {"regex": "[0-9]+"}
    openai = {"custom_id": "r", "method": "POST", "url": "/v1/chat/completions",
              "body": {"messages": [{"role": "user", "content": "hi"}], "response_format": schema_format}}
    assert parse_request(openai).overrides["structured_outputs"] == {"json": PERSON}
    for row, why in [({"response_format": {"type": "yaml"}}, "type must be"),
                     ({"response_format": {"type": "json_schema"}}, "json_schema.schema"),
                     ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "give one"),
                     ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, "give one"),
                     ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "exactly one"),
                     ({"structural_tag": "{}"}, "structural tags")]:
        with pytest.raises(BadRow, match=why):
            parse_request({"prompt": "x", **row})


# ---- the engine, on a tiny random model -----------------------------------------------------------------------------

def _masked(llm, params: StructuredOutputsParams, prefix: list[int]) -> set[int]:
    """Token ids the constraint allows after the output tokens `prefix`, from a fresh matcher."""
    matcher = llm.llm_engine.structured_outputs.constraint(params).matcher
    assert matcher.consume_tokens(prefix)
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

    mask = allocate_token_bitmask(1, llm.model_config.vocab_size)
    fill_next_token_bitmask(matcher, mask)
    bits = np.unpackbits(mask.view(np.uint8), bitorder="little")[: llm.model_config.vocab_size]
    return set(np.flatnonzero(bits).tolist())


def test_random_model_outputs_match_their_constraints(tiny_model_dir):
    """A random model's every token is one the constraint allowed (the mask is applied, the matcher fed), outputs
    parse, and logprobs are those of the masked distribution (no forbidden token among the top ones)."""
    llm = llm_for(tiny_model_dir, max_num_seqs=4)
    constraints = [StructuredOutputsParams(json=PERSON, disable_any_whitespace=True),
                   StructuredOutputsParams(regex=r"(ab|cd)[0-9]{2,4}"),
                   StructuredOutputsParams(choice=["yes", "no", "maybe not"]),
                   StructuredOutputsParams(grammar='start: "(" item ("," item)* ")"\nitem: /[a-c]/'),
                   StructuredOutputsParams(json_object=True, disable_any_whitespace=True)]
    params = [SamplingParams(max_tokens=60, temperature=t, seed=s, logprobs=3, structured_outputs=c)
              for c in constraints for t, s in ((0, None), (1.0, 7))]
    outs = llm.generate(["Hello there", "Once upon a time"] * (len(params) // 2), params)
    for out, p in zip(outs, params):
        comp = out.outputs[0]
        c = p.structured_outputs
        for i, token in enumerate(comp.token_ids):
            allowed = _masked(llm, c, comp.token_ids[:i])
            assert token in allowed
            assert set(comp.logprobs[i]) <= allowed, "top logprobs of the masked distribution"
        if comp.finish_reason == "stop":
            assert comp.structured_output_complete
            if c.json is not None:
                jsonschema.validate(json.loads(comp.text), PERSON)
            elif c.json_object:
                assert isinstance(json.loads(comp.text), dict)
            elif c.regex is not None:
                assert re.fullmatch(c.regex, comp.text)
            elif c.choice is not None:
                assert comp.text in c.choice
            else:
                assert re.fullmatch(r"\([a-c](,[a-c])*\)", comp.text)
        else:
            assert comp.finish_reason == "length" and comp.structured_output_complete is False
    assert sum(o.outputs[0].finish_reason == "stop" for o in outs) >= 6, "most constraints end well before 60 tokens"
    assert llm.stats()["structured_output_grammars"] == len(constraints)


def test_constraints_keep_n_seeds_preemption_and_stops(tiny_model_dir):
    """n > 1 forks get their own matchers; seeded outputs repeat; a KV cache small enough to preempt gives the same
    outputs; a stop string cuts a constrained output (then incomplete); max_tokens ends one with finish 'length'."""
    constraint = {"regex": r"[a-z]{3,40}"}
    prompts = [f"Prompt number {i} says" for i in range(6)]
    params = SamplingParams(n=3, max_tokens=24, temperature=1.0, seed=5, structured_outputs=constraint)
    roomy = llm_for(tiny_model_dir).generate(prompts, params)
    tight_llm = llm_for(tiny_model_dir, num_kv_blocks=12, block_size=4, max_num_seqs=6)
    tight = tight_llm.generate(prompts, params)
    assert tight_llm.llm_engine.scheduler.num_preemptions > 0, "the KV budget was meant to force preemption"
    for a, b in zip(roomy, tight):
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
        for c in a.outputs:
            assert re.fullmatch(r"[a-z]{3,40}", c.text) or (c.finish_reason == "length"
                                                            and re.fullmatch(r"[a-z]*", c.text))
        assert len({tuple(c.token_ids) for c in a.outputs}) > 1, "forks sample their own tokens"

    llm = llm_for(tiny_model_dir)
    long = llm.generate(["x"], SamplingParams(max_tokens=3, temperature=0,
                                              structured_outputs={"regex": "[a-z]{50}"}))[0].outputs[0]
    assert long.finish_reason == "length" and long.structured_output_complete is False
    free = llm.generate(["x"], SamplingParams(max_tokens=40, temperature=0,
                                              structured_outputs={"regex": "[a-z]{20}"}))[0].outputs[0]
    stop = free.text[5:7]
    cut = llm.generate(["x"], SamplingParams(max_tokens=40, temperature=0, stop=[stop],
                                             structured_outputs={"regex": "[a-z]{20}"}))[0].outputs[0]
    assert cut.text == free.text[: free.text.index(stop)] and cut.finish_reason == "stop"
    assert cut.structured_output_complete is False


def test_matchers_grouped_by_family_give_the_same_outputs(tiny_model_dir, monkeypatch):
    """With several llguidance worker threads, new sequences' matchers come from one template per thread in turn
    and a step hands them over grouped by template (_by_family): every token and logprob as with one thread, and
    the groups keep each family's own order."""
    from tinyvllm.engine import structured_outputs as so

    params = [SamplingParams(max_tokens=30, temperature=1.0, seed=s, logprobs=2,
                             structured_outputs={"regex": r"(ab|cd)[0-9]{2,9}"} if s % 2 else {"json": PERSON})
              for s in range(7)]
    prompts = [f"Row {i} asks" for i in range(7)]

    def run(cpus: int):
        monkeypatch.setattr(so.os, "sched_getaffinity", lambda pid: set(range(cpus)))
        llm = llm_for(tiny_model_dir, max_num_seqs=4)
        assert llm.llm_engine.structured_outputs.num_threads == max(1, cpus - 2)
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, params)], llm

    one, _ = run(2)
    several, llm = run(5)
    assert several == one
    manager = llm.llm_engine.structured_outputs
    pairs = [(so.OutputConstraint(object(), family), value) for value, family in enumerate([2, 0, 1, 0, 2, 1, 0])]
    constraints, matchers = manager._by_family(pairs)
    assert [c.family for c in constraints] == [0, 0, 0, 1, 1, 2, 2]
    assert [v for _, v in matchers] == [1, 3, 6, 2, 5, 0, 4]
    assert [m for m, _ in matchers] == [c.matcher for c in constraints]


def test_a_constraint_the_argmax_already_meets_changes_nothing(tiny_model_dir):
    """Where the mask allows the greedy token at every step, the constrained output is the unconstrained one."""
    llm = llm_for(tiny_model_dir)
    tokenizer = llm.get_tokenizer()
    # printable ASCII tokens only (a random model's free text is otherwise full of partial UTF-8 characters)
    ascii_ids = [t for t in range(3, llm.model_config.vocab_size)
                 if re.fullmatch(r"[ -~]+", tokenizer.decode([t], skip_special_tokens=False))]
    for prompt in ("Hello there", "Once upon a time"):
        free = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0, allowed_token_ids=ascii_ids))[0]
        text = free.outputs[0].text
        assert len(text) > 5
        # the free output's characters (as Rust regex hex escapes), then anything
        pattern = "".join(f"\\x{{{ord(c):X}}}" for c in text) + "(?s:.*)"
        constrained = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0, allowed_token_ids=ascii_ids,
                                                            structured_outputs={"regex": pattern}))[0]
        assert constrained.outputs[0].token_ids == free.outputs[0].token_ids


def test_disable_additional_properties_closes_every_object_schema():
    from tinyvllm.engine.structured_outputs import _no_additional_properties

    schema = {"type": "object", "properties": {
        "type": {"type": "string"}, "properties": {"type": "object", "properties": {"x": {"type": "integer"}}},
        "list": {"type": "array", "items": {"properties": {"y": {}}}}},
        "anyOf": [{"type": "object"}, {"type": "string"}], "$defs": {"d": {"type": "object", "additionalProperties": True}}}
    out = _no_additional_properties(schema)
    assert out["additionalProperties"] is False
    assert set(out["properties"]) == {"type", "properties", "list"}, "property names are data, not keywords"
    assert out["properties"]["type"] == {"type": "string"}
    assert out["properties"]["properties"]["additionalProperties"] is False
    assert out["properties"]["list"]["items"]["additionalProperties"] is False
    assert out["anyOf"] == [{"type": "object", "additionalProperties": False}, {"type": "string"}]
    assert out["$defs"]["d"]["additionalProperties"] is True  # set by the schema: kept
    assert "additionalProperties" not in schema, "the caller's schema is not modified"


def test_invalid_constraints_are_error_rows(tiny_model_dir):
    llm = llm_for(tiny_model_dir)
    bad = [{"json": {"type": "objectx"}}, {"json": "{not json"}, {"regex": "a("}, {"grammar": "start: nothing_here"}]
    outs = llm.generate(["hi"] * (len(bad) + 1),
                        [SamplingParams(max_tokens=4, structured_outputs=b) for b in bad]
                        + [SamplingParams(max_tokens=4, structured_outputs={"choice": ["ok"]})], error_outputs=True)
    for out, b in zip(outs, bad):
        assert out.outputs[0].finish_reason == "error"
        assert out.error.startswith(f"invalid structured_outputs.{next(iter(b))}"), out.error
    assert outs[-1].error is None and outs[-1].outputs[0].text == "ok"
    with pytest.raises(ValueError, match="invalid structured_outputs.regex"):
        llm.generate(["hi"], SamplingParams(structured_outputs={"regex": "a("}))


def test_missing_llguidance_is_one_clear_error(tiny_model_dir, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_llguidance(name, *args, **kwargs):
        if name.startswith("llguidance"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    llm = llm_for(tiny_model_dir)
    monkeypatch.setattr(builtins, "__import__", no_llguidance)
    out = llm.generate(["hi"], SamplingParams(structured_outputs={"regex": "a"}), error_outputs=True)[0]
    assert "pip install 'tinyvllm[structured]'" in out.error
    assert llm.generate(["hi"], SamplingParams(max_tokens=2))[0].error is None  # the rest is unaffected


# ---- jobs -------------------------------------------------------------------------------------------------------------

def _run(*args):
    return CliRunner().invoke(main, [*map(str, args)])


def test_cli_flags_and_job_files_set_the_default_constraint(tiny_model_dir, tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"prompt": "a"}) + "\n" + json.dumps({"prompt": "b", "guided_choice": ["zz"]}) + "\n"
                   + json.dumps({"prompt": "c", "structured_outputs": {"json": {"type": "objectx"}}}) + "\n")
    common = ["--model", tiny_model_dir, "--input", src, "--backend", "numpy", "--quiet", "--max-tokens", "30",
              "--temperature", "0"]

    result = _run("run", *common, "--output", tmp_path / "choice.parquet", "--choice", "yes,no")
    assert result.exit_code == 0, result.output
    rows = pq.read_table(tmp_path / "choice.parquet").to_pylist()
    assert rows[0]["completion"] in ("yes", "no") and rows[0]["structured_output_complete"]
    assert rows[1]["completion"] == "zz"  # the row's own constraint wins
    assert rows[2]["finish_reason"] == "error" and "objectx" in rows[2]["error"]

    schema_file = tmp_path / "schema.json"
    schema_file.write_text(json.dumps(PERSON))
    result = _run("run", *common, "--output", tmp_path / "schema.parquet", "--json-schema", schema_file,
                  "--max-tokens", "80")
    assert result.exit_code == 0, result.output
    rows = pq.read_table(tmp_path / "schema.parquet").to_pylist()
    if rows[0]["finish_reason"] == "stop":
        jsonschema.validate(json.loads(rows[0]["completion"]), PERSON)
    else:
        assert rows[0]["structured_output_complete"] is False
    summary = json.loads((tmp_path / "schema.summary.json").read_text())
    assert summary["structured_output_incomplete"] == sum(r["structured_output_complete"] is False for r in rows)
    short = _run("run", *common, "--output", tmp_path / "short.parquet", "--json-schema", schema_file,
                 "--max-tokens", "2")
    assert short.exit_code == 0, short.output
    assert json.loads((tmp_path / "short.summary.json").read_text())["structured_output_incomplete"] == 1
    assert [r["structured_output_complete"] for r in pq.read_table(tmp_path / "short.parquet").to_pylist()] == \
        [False, True, None]  # the row's own choice "zz" fits in 2 tokens; the bad schema is an error row

    job = tmp_path / "job.toml"
    job.write_text(f'input = "in.jsonl"\noutput = "job.parquet"\nmodel = "{tiny_model_dir}"\nbackend = "numpy"\n'
                   'quiet = true\n[sampling]\nmax_tokens = 20\ntemperature = 0\n'
                   '[sampling.structured_outputs]\nregex = "[0-9]{3}"\n')
    result = _run("job", job)
    assert result.exit_code == 0, result.output
    assert re.fullmatch("[0-9]{3}", pq.read_table(tmp_path / "job.parquet").to_pylist()[0]["completion"])

    result = _run("run", *common, "--output", tmp_path / "x.parquet", "--regex", "a", "--choice", "a")
    assert result.exit_code == 2 and "give one of" in result.output
    result = _run("run", *common, "--output", tmp_path / "x.parquet", "--json-schema", tmp_path / "missing.json")
    assert result.exit_code == 2 and "missing.json" in result.output
    (tmp_path / "bad.json").write_text("{not json")
    result = _run("run", *common, "--output", tmp_path / "x.parquet", "--json-schema", tmp_path / "bad.json")
    assert result.exit_code == 2 and "bad.json" in result.output and "Traceback" not in result.output
    for flags, why in [(["--structured-outputs", '{"regex": "a", "choice": ["a"]}'], "exactly one"),
                       (["--choice", ","], "structured_outputs.choice"),
                       (["--structured-outputs", "[1]"], "must be a JSON object")]:
        result = _run("run", *common, "--output", tmp_path / "x.parquet", *flags)
        assert result.exit_code != 0 and why in result.output and "Traceback" not in result.output, result.output
    bad_job = tmp_path / "bad.toml"
    bad_job.write_text('input = "in.jsonl"\noutput = "bad.parquet"\n[sampling.structured_outputs]\nregex = 3\n')
    result = _run("job", bad_job)
    assert result.exit_code == 2 and "structured_outputs.regex must be a non-empty string" in result.output


# ---- the real model -----------------------------------------------------------------------------------------------------

SCHEMAS = [
    PERSON,
    {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                      "country": {"type": "string", "maxLength": 20},
                                      "population": {"type": "integer", "minimum": 0}},
     "required": ["city", "country", "population"], "additionalProperties": False},
    {"type": "object", "properties": {"sentiment": {"enum": ["positive", "negative", "neutral"]},
                                      "confidence": {"type": "number", "minimum": 0, "maximum": 1}},
     "required": ["sentiment", "confidence"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 10},
                                               "minItems": 1, "maxItems": 3}},
     "required": ["tags"], "additionalProperties": False},
    {"type": "object", "properties": {"book": {"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 24}, "year": {"type": "integer", "minimum": 1400, "maximum": 2026}},
        "required": ["title", "year"], "additionalProperties": False}},
     "required": ["book"], "additionalProperties": False},
    {"type": "object", "properties": {"answer": {"type": "boolean"}, "reason": {"type": "string", "maxLength": 30}},
     "required": ["answer", "reason"], "additionalProperties": False},
    {"type": "object", "properties": {"x": {"type": "number", "minimum": -10, "maximum": 10},
                                      "y": {"type": "number", "minimum": -10, "maximum": 10}},
     "required": ["x", "y"], "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                      "shade": {"type": "integer", "minimum": 1, "maximum": 9}},
     "required": ["color"], "additionalProperties": False},
    {"type": "object", "properties": {"steps": {"type": "array", "maxItems": 2, "items": {
        "type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 9},
                                         "do": {"type": "string", "maxLength": 12}},
        "required": ["n", "do"], "additionalProperties": False}}},
     "required": ["steps"], "additionalProperties": False},
    {"type": "object", "properties": {"email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"},
                                      "id": {"type": "integer", "minimum": 1, "maximum": 99999}},
     "required": ["email", "id"], "additionalProperties": False},
]
TOPICS = ["a famous scientist", "a big city", "a movie review", "a cooking blog post", "an old book"]


@pytest.mark.model
def test_real_model_json_schemas_choices_and_regexes(default_model_path):
    """50 rows, 10 schemas (nested objects, enums, arrays, bounded numbers, required fields, a pattern) on
    SmolLM2-135M: every output parses and validates; choices and regexes hold; an invalid schema is one error row;
    greedy rows whose free output already meets a constraint come out the same under it."""
    llm = LLM(default_model_path, backend="numpy", max_num_seqs=64)
    messages, params = [], []
    for i, schema in enumerate(SCHEMAS):
        for topic in TOPICS:
            messages.append([{"role": "user", "content": f"Answer in JSON about {topic}. Schema: "
                                                         + json.dumps(schema)}])
            params.append(SamplingParams(max_tokens=160, temperature=0 if i % 2 else 0.7, seed=i,
                                         structured_outputs={"json": schema}))
    messages += [[{"role": "user", "content": "Is the sky blue? Answer yes or no."}],
                 [{"role": "user", "content": "What is 12 times 12?"}],
                 [{"role": "user", "content": "Say hi"}]]
    params += [SamplingParams(max_tokens=8, temperature=0.8, seed=1, structured_outputs={"choice": ["yes", "no"]}),
               SamplingParams(max_tokens=8, temperature=0, structured_outputs={"regex": r"[0-9]{2,4}"}),
               SamplingParams(max_tokens=8, structured_outputs={"json": {"type": "object", "required": 3}})]
    outs = llm.chat(messages, params, error_outputs=True)
    for out, p in zip(outs[:50], params):
        comp = out.outputs[0]
        assert comp.finish_reason == "stop" and comp.structured_output_complete, (comp.text, comp.finish_reason)
        jsonschema.validate(json.loads(comp.text), p.structured_outputs.json)
    assert outs[50].outputs[0].text in ("yes", "no")
    assert re.fullmatch(r"[0-9]{2,4}", outs[51].outputs[0].text)
    assert outs[52].outputs[0].finish_reason == "error" and "structured_outputs.json" in outs[52].error
    assert llm.stats()["structured_output_grammars"] == len(SCHEMAS) + 2

    # Free greedy outputs that already are JSON objects: constrained to "any JSON object", the text is the same.
    ask = [[{"role": "user", "content": f'Reply with only this JSON: {{"id": {i}, "ok": true}}'}] for i in range(4)]
    free = llm.chat(ask, SamplingParams(max_tokens=40, temperature=0))
    same = [i for i, o in enumerate(free) if _is_json_object(o.outputs[0].text)]
    assert same, "the prompts were meant to make the model write JSON on its own"
    constrained = llm.chat([ask[i] for i in same],
                           SamplingParams(max_tokens=40, temperature=0, structured_outputs={"json_object": True}))
    for i, out in zip(same, constrained):
        assert out.outputs[0].text == free[i].outputs[0].text


def _is_json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False
