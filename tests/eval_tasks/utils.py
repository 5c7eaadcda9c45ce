"""Datasets of the test tasks, read from the JSONL files next to this module (no hub access)."""

import json
from pathlib import Path

import datasets

HERE = Path(__file__).parent


def _split(name: str) -> datasets.Dataset:
    lines = (HERE / f"{name}.jsonl").read_text(encoding="utf-8").splitlines()
    return datasets.Dataset.from_list([json.loads(line) for line in lines if line.strip()])


def mc_dataset(**kwargs) -> datasets.DatasetDict:
    return datasets.DatasetDict({"train": _split("mc_train"), "test": _split("mc_test")})


def gen_dataset(**kwargs) -> datasets.DatasetDict:
    return datasets.DatasetDict({"test": _split("gen_test")})
