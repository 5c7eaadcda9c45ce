"""A synthetic multiple-choice task made at load time (no files): arithmetic and word questions, four choices each.

Seeded, so every run and every model sees the same items. For timing: tinyvllm_mc1000 scores its 1,000 test items
after five few-shot examples drawn from the 50 train items, one draw per item, as most few-shot tasks do.
"""

import random

import datasets

WORDS = ["apple", "river", "engine", "token", "garden", "silver", "window", "planet", "market", "forest", "pencil",
         "castle", "rocket", "violin", "harbor", "meadow", "lantern", "glacier", "compass", "thunder"]


def _arithmetic(rng: random.Random) -> tuple[str, list[int], int]:
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    op, value = rng.choice([("plus", a + b), ("minus", a - b), ("times", a * b)])
    wrong = rng.sample([value + d for d in range(-12, 13) if d], 3)
    return f"What is {a} {op} {b}?", [value, *wrong], value


def _letters(rng: random.Random) -> tuple[str, list[int], int]:
    word = rng.choice(WORDS)
    wrong = rng.sample([n for n in range(3, 11) if n != len(word)], 3)
    return f"How many letters are in the word \"{word}\"?", [len(word), *wrong], len(word)


def _alphabetical(rng: random.Random) -> tuple[str, list[str], str]:
    words = rng.sample(WORDS, 4)
    return f"Which word comes first in the alphabet: {', '.join(words)}?", words, min(words)


def _item(rng: random.Random) -> dict:
    question, choices, right = rng.choice([_arithmetic, _letters, _alphabetical])(rng)
    rng.shuffle(choices)
    return {"question": question, "choices": [str(c) for c in choices], "answer": choices.index(right)}


def mc_dataset(num_items: int = 1000, num_train: int = 50, seed: int = 0, **kwargs) -> datasets.DatasetDict:
    rng = random.Random(seed)
    train = [_item(rng) for _ in range(num_train)]
    test = [_item(rng) for _ in range(num_items)]
    return datasets.DatasetDict({"train": datasets.Dataset.from_list(train), "test": datasets.Dataset.from_list(test)})
