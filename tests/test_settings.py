"""Settings declared once with `setting()`: SamplingParams' fields drive its checks, the rows' fields, the CLI's
flags and the job file's keys; job files name a mistyped key's nearest valid ones."""

import dataclasses
from pathlib import Path

import pytest
from click.testing import CliRunner

from tinyvllm.cli import SAMPLING_FLAGS, main
from tinyvllm.config import SettingError, check_settings, setting, settings
from tinyvllm.errors import JobError
from tinyvllm.io import readers
from tinyvllm.jobs.file import JOB_FILE_KEYS, load_job_file
from tinyvllm.sampling_params import OVERRIDABLE_FIELDS, SamplingParams

ROOT = Path(__file__).resolve().parent.parent


def test_every_sampling_field_is_declared_and_reaches_rows_flags_and_job_files():
    names = [f.name for f in dataclasses.fields(SamplingParams)]
    assert [s.name for s in settings(SamplingParams)] == names  # no field without a declaration
    assert OVERRIDABLE_FIELDS == tuple(names)
    params = {p.name for p in main.commands["run"].params}
    for s in settings(SamplingParams):
        assert (s.name in SAMPLING_FLAGS) == (s.meta["flag"] is not False), s.name
        assert s.name not in SAMPLING_FLAGS or s.name in params, s.name
        assert f"sampling.{s.name}" in JOB_FILE_KEYS, s.name
    assert readers.INT_FIELDS == ("n", "max_tokens", "top_k", "seed", "min_tokens", "logprobs", "prompt_logprobs",
                                  "prompt_logprobs_start", "truncate_prompt_tokens")


@pytest.mark.parametrize("fields,message", [
    ({"n": 257}, "invalid n=257: must be <= 256"),
    ({"temperature": 0.001}, "invalid temperature=0.001: must be >= 0.01 or 0"),
    ({"top_p": 0}, "invalid top_p=0.0: must be > 0"),
    ({"presence_penalty": 2.5}, "invalid presence_penalty=2.5: must be <= 2"),
    ({"stop": ["a", ""]}, "invalid stop=['a', '']: must be a string or a list of non-empty strings"),
    ({"stop_token_ids": [-1]}, "invalid stop_token_ids=[-1]: must be a list of integers in [0, 2147483647]"),
    ({"logit_bias": {"3": 101}}, "invalid logit_bias={3: 101.0}: must map token ids to numbers in [-100, 100]"),
    ({"logit_bias": {-3: 1}}, "invalid logit_bias={-3: 1.0}: must map token ids"),
    ({"logit_bias": {1.5: 1}}, "invalid logit_bias={1.5: 1}: must map token ids to numbers"),  # not truncated to 1
    ({"logit_bias": {"2.5": 1}}, "invalid logit_bias={'2.5': 1}: must map token ids to numbers"),
    ({"allowed_token_ids": []}, "invalid allowed_token_ids=[]: must be a non-empty list of token ids"),
    ({"bad_words": ["ok", " "]}, "invalid bad_words=['ok', ' ']: must be a list of words, not blanks"),
    ({"ignore_eos": 1}, "invalid ignore_eos=1: must be true or false"),
    ({"spaces_between_special_tokens": "no"}, "invalid spaces_between_special_tokens='no': must be true or false"),
    ({"temperature": 10**400}, "must be a number"),
    ({"min_tokens": 5, "max_tokens": 4}, "invalid min_tokens=5: must be <= max_tokens (4)"),
    ({"truncate_prompt_tokens": -2}, "invalid truncate_prompt_tokens=-2: must be >= -1"),
    ({"truncate_prompt_tokens": 0}, "invalid truncate_prompt_tokens=0: must be >= 1, or -1"),
    ({"truncate_prompt_tokens": "5"}, "invalid truncate_prompt_tokens='5'"),
])
def test_sampling_checks_come_from_the_declarations(fields, message):
    with pytest.raises(ValueError) as e:
        SamplingParams(**fields)
    assert message in str(e.value)


def test_declared_types_are_normalized():
    params = SamplingParams(temperature=0, top_p=1, stop="\n", stop_token_ids=(3,), top_k=-1, logit_bias={"7": 1})
    assert params.temperature == 0.0 and isinstance(params.temperature, float) and isinstance(params.top_p, float)
    assert params.stop == ["\n"] and params.stop_token_ids == [3] and params.top_k == 0
    assert params.logit_bias == {7: 1.0}
    assert SamplingParams(logit_bias={3.0: 1, True: 2, "4": 3}).logit_bias == {3: 1.0, 1: 2.0, 4: 3.0}
    assert SamplingParams().stop is not SamplingParams().stop  # a list default is copied per instance


def test_setting_declarations_check_lists_and_refuse_unknown_types():
    @dataclasses.dataclass
    class Knobs:
        sizes: list[int] = setting([1], "sizes", low=1, high=8)

        def __post_init__(self):
            check_settings(self)

    assert Knobs([2, 8]).sizes == [2, 8]
    with pytest.raises(SettingError, match=r"invalid sizes=\[9\]: must be a list of integers in \[1, 8\]"):
        Knobs([9])

    @dataclasses.dataclass
    class Odd:
        shape: tuple[int, int] = setting((1, 1), "a tuple")

    with pytest.raises(TypeError, match="unsupported setting type"):
        settings(Odd)


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "job.toml"
    path.write_text('input = "in.jsonl"\noutput = "out.parquet"\n' + text)
    return path


@pytest.mark.parametrize("text,message", [
    ("max_num_seq = 4\n", "unknown key 'max_num_seq' (did you mean max_num_seqs?)"),
    ("[sampling]\nmax_token = 4\n", "unknown key 'sampling.max_token' (did you mean sampling.max_tokens?)"),
    ("temperature = 0.5\n", "unknown key 'temperature' (did you mean sampling.temperature?)"),
    ("[sampling]\nbeam_width = 2\n", "unknown key 'sampling.beam_width' (jobs/example.toml lists every key)"),
])
def test_an_unknown_key_names_the_nearest_valid_ones_in_one_short_line(tmp_path, text, message):
    with pytest.raises(JobError) as e:
        load_job_file(write(tmp_path, text), {}, {})
    assert str(e.value).endswith(message) and len(str(e.value)) < len(str(tmp_path)) + 150


def test_every_sampling_field_is_a_job_file_key(tmp_path):
    cfg = load_job_file(write(tmp_path, '[sampling]\nstop = "\\n"\nprompt_logprobs = 2\nprompt_logprobs_start = 1\n'
                                        "detokenize = true\nspaces_between_special_tokens = false\nlogprobs = 3\n"
                                        "seed = 5\n"), {}, {})
    params = cfg.sampling_params()
    assert params.stop == ["\n"] and params.prompt_logprobs == 2 and params.prompt_logprobs_start == 1
    assert params.spaces_between_special_tokens is False and params.seed == 5
    assert cfg.logprobs == 3 and params.logprobs == 3  # [sampling] logprobs is the job's logprobs
    assert load_job_file(write(tmp_path, "[sampling]\nlogprobs = 3\n"), {"logprobs": 1}, {}).logprobs == 1
    with pytest.raises(JobError, match="logprobs = 2 and sampling.logprobs = 3 disagree"):
        load_job_file(write(tmp_path, "logprobs = 2\n[sampling]\nlogprobs = 3\n"), {}, {})
    with pytest.raises(JobError, match=r"sampling.stop = 5 has the wrong type \(expected a string or a list\)"):
        load_job_file(write(tmp_path, "[sampling]\nstop = 5\n"), {}, {})


def test_job_help_says_values_come_from_the_file():
    job_help = CliRunner().invoke(main, ["job", "--help"]).output
    run_help = CliRunner().invoke(main, ["run", "--help"]).output
    assert "The values come from the file" in job_help and "[default:" not in job_help
    assert "[default: 16]" in run_help and "[default: 256]" in run_help  # max_tokens, max_num_seqs
