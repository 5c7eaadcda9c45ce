"""A row's SamplingParams when it sets no sampling field: the job's defaults (checked once for the job) with the
row's seed, the same as building and checking them for the row; a row that sets one is still checked."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from tinyvllm.io.readers import Row, parse_request
from tinyvllm.jobs.config import JobConfig
from tinyvllm.jobs.run import _row_seed, prepare_request
from tinyvllm.sampling_params import SamplingParams


class NoTemplate:
    """A tokenizer stand-in: prompt rows never reach the chat template."""

    def apply_chat_template(self, *args, **kwargs):
        raise AssertionError("a prompt row was rendered")


def job_config(seed: int = 7) -> JobConfig:
    cfg = JobConfig(Path("in.jsonl"), Path("out.parquet"), Path("model"), sampling={"max_tokens": 16})
    return replace(cfg, engine=replace(cfg.engine, seed=seed))


@pytest.mark.parametrize("index", [0, 1, 12345])
def test_a_plain_row_runs_with_the_defaults_and_its_seed(index):
    cfg = job_config()
    defaults = SamplingParams(max_tokens=16, temperature=0.5, stop=["\n\n"], logit_bias={3: 1.0})
    _, _, params = prepare_request(Row(index, str(index), prompt="hi"), NoTemplate(), defaults, cfg, 4096)
    assert params == replace(defaults, seed=_row_seed(cfg.engine.seed, index))  # what checking them anew makes
    assert params is not defaults and defaults.seed is None  # the job's defaults are left as they were


def test_rows_get_their_own_params():
    cfg, defaults = job_config(), SamplingParams(max_tokens=16)
    first, second = (prepare_request(Row(i, str(i), prompt="hi"), NoTemplate(), defaults, cfg, 4096)[2]
                     for i in (0, 1))
    assert first is not second and first.seed != second.seed


def test_a_seed_in_the_defaults_is_every_plain_rows():
    cfg, defaults = job_config(), SamplingParams(max_tokens=16, seed=99)
    _, _, params = prepare_request(Row(3, "3", prompt="hi"), NoTemplate(), defaults, cfg, 4096)
    assert params == defaults


def test_a_row_that_sets_a_field_is_checked_against_the_job():
    cfg, defaults = job_config(), SamplingParams(max_tokens=16)
    row = Row(0, "0", prompt="hi", overrides={"min_tokens": 32})  # more than the job's max_tokens
    with pytest.raises(ValueError, match="min_tokens"):
        prepare_request(row, NoTemplate(), defaults, cfg, 4096)
    _, _, params = prepare_request(replace(row, overrides={"temperature": 0.25}), NoTemplate(), defaults, cfg, 4096)
    assert params.temperature == 0.25 and params.seed == _row_seed(cfg.engine.seed, 0)


def test_parsing_still_checks_the_fields_a_row_sets():
    assert parse_request({"prompt": "hi"}).overrides == {}
    assert parse_request({"prompt": "hi", "max_tokens": 8.0}).overrides == {"max_tokens": 8}
    with pytest.raises(ValueError, match="temperature"):
        parse_request({"prompt": "hi", "temperature": -1})
