"""Grade-school word problems, generated procedurally, character level, exactly verifiable.

Seven operation types (add, sub, mul, div, compare, times, two-step), each with three or four
phrasings, names and objects drawn at random: the kinds of tokens (names, numbers, operation
words) and the arithmetic differ between problem types, so experts have something to
specialise on. A problem is one line `prompt=answer.`: the model reads the prompt up to `=`
and must write the integer answer and the full stop; exact match of that string is the metric.

Splits are fixed by a seed: `split("train" | "val" | "test")` always returns the same problems,
and no prompt of the test or validation split occurs in the train split.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

SEED = 1234
SPLIT_SIZES = {"train": 60_000, "val": 1_000, "test": 1_000}
SEQ_LENGTH = 64  # every problem line fits, with room: the longest is checked below

PAD = 0
CHARS = " abcdefghijklmnopqrstuvwxyz0123456789.,?=:"
VOCAB = {c: i + 1 for i, c in enumerate(CHARS)}
INV_VOCAB = {i: c for c, i in VOCAB.items()}
VOCAB_SIZE = 64  # padded: ids 0 (pad) .. len(CHARS) are used

NAMES = ("tom", "ann", "bob", "eva", "sam", "mia", "leo", "zoe")
OBJECTS = ("apples", "pens", "cards", "books", "eggs", "coins", "shells", "cups")

# (kind, template); {n}, {m}: names, {o}: object, {a} {b} {c}: numbers
TEMPLATES = {
    "add": (
        "{n} has {a} {o} and gets {b} more. how many?",
        "{a} {o} and {b} {o}. total?",
        "{n} had {a} {o}, found {b}. now?",
        "add {a} and {b}:",
    ),
    "sub": ("{n} has {a} {o} and gives {b} away. left?", "{n} had {a} {o}, lost {b}. now?", "take {b} from {a}:"),
    "mul": ("{a} bags of {b} {o}. total?", "{n} buys {a} packs of {b} {o}. how many?", "{a} times {b}:"),
    "div": ("{a} {o} shared by {b} kids. each?", "{n} puts {a} {o} in {b} equal rows. per row?", "{a} split in {b}:"),
    "compare": ("{n} has {a} {o}, {m} has {b}. how many more has {n}?", "{n} {a}, {m} {b}. difference?"),
    "times": (
        "{n} has {a} {o}. {m} has twice as many. {m}?",
        "{n} has {a} {o}, {m} has half as many. {m}?",
        "{n} has {a} {o}, {m} has 3 times as many. {m}?",
    ),
    "two_step": ("{n} has {a} {o}, gets {b}, gives {c}. left?", "{a} {o} plus {b} minus {c}:"),
}
KINDS = tuple(TEMPLATES)


@dataclass(frozen=True)
class Problem:
    kind: str
    prompt: str  # ends with the character before "="
    answer: str  # the integer, as written after "="

    @property
    def text(self) -> str:
        return f"{self.prompt}={self.answer}."


def _numbers(kind: str, template: str, rng: random.Random) -> tuple[dict, int]:
    r = rng.randint
    if kind == "add":
        a, b = r(1, 60), r(1, 40)
        return dict(a=a, b=b), a + b
    if kind == "sub":
        a = r(5, 80)
        b = r(1, a - 1)
        return dict(a=a, b=b), a - b
    if kind == "mul":
        a, b = r(2, 9), r(2, 12)
        return dict(a=a, b=b), a * b
    if kind == "div":
        b, q = r(2, 9), r(2, 12)
        return dict(a=b * q, b=b), q
    if kind == "compare":
        b = r(1, 60)
        a = b + r(1, 30)
        return dict(a=a, b=b), a - b
    if kind == "times":
        if "twice" in template:
            a = r(2, 45)
            return dict(a=a), 2 * a
        if "half" in template:
            a = 2 * r(1, 40)
            return dict(a=a), a // 2
        a = r(2, 30)
        return dict(a=a), 3 * a
    a, b = r(5, 50), r(1, 30)  # two_step
    c = r(1, a + b - 1)
    return dict(a=a, b=b, c=c), a + b - c


def make_problem(rng: random.Random) -> Problem:
    kind = rng.choice(KINDS)
    template = rng.choice(TEMPLATES[kind])
    nums, answer = _numbers(kind, template, rng)
    n, m = rng.sample(NAMES, 2)
    prompt = template.format(n=n, m=m, o=rng.choice(OBJECTS), **nums)
    return Problem(kind, prompt, str(answer))


def _generate_all() -> dict[str, list[Problem]]:
    """Test and validation first, then train without their prompts (no leakage)."""
    rng = random.Random(SEED)
    out, seen = {}, set()
    for name in ("test", "val", "train"):
        problems = []
        while len(problems) < SPLIT_SIZES[name]:
            p = make_problem(rng)
            if name != "train":
                if p.prompt in seen:
                    continue
                seen.add(p.prompt)
            elif p.prompt in seen:
                continue
            problems.append(p)
        out[name] = problems
    return out


_CACHE: dict[str, list[Problem]] = {}


def split(name: str) -> list[Problem]:
    """The fixed problems of split "train" | "val" | "test" (same list on every call and machine)."""
    if not _CACHE:
        _CACHE.update(_generate_all())
    if name not in _CACHE:
        raise ValueError(f"split {name!r} is not one of {tuple(SPLIT_SIZES)}")
    return _CACHE[name]


def encode(text: str) -> list[int]:
    return [VOCAB[c] for c in text]


def decode(ids) -> str:
    return "".join(INV_VOCAB.get(int(i), "") for i in ids)


def batch(problems: list[Problem]) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [b, SEQ_LENGTH] int64 right-padded with PAD, answer_mask [b, SEQ_LENGTH] bool).

    answer_mask marks the positions whose *next* token is part of the answer or its full stop:
    position of "=" predicts the first digit, ..., the last digit predicts ".". The loss, the
    KL and teacher-forced metrics are taken there."""
    tokens = torch.full((len(problems), SEQ_LENGTH), PAD, dtype=torch.int64)
    mask = torch.zeros((len(problems), SEQ_LENGTH), dtype=torch.bool)
    for i, p in enumerate(problems):
        ids = encode(p.text)
        if len(ids) > SEQ_LENGTH:
            raise ValueError(f"problem longer than {SEQ_LENGTH} characters: {p.text!r}")
        tokens[i, : len(ids)] = torch.tensor(ids)
        eq = len(p.prompt)
        mask[i, eq : len(ids) - 1] = True
    return tokens, mask


def trim(tokens: torch.Tensor, *rest: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Drop the all-padding columns at the right (shorter forward passes, same results: the
    model is causal and padding only ever follows the text)."""
    used = int((tokens != PAD).any(0).nonzero().max()) + 1
    return (tokens[:, :used], *(r[:, :used] for r in rest))


def prompts(problems: list[Problem]) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [b, SEQ_LENGTH] with each prompt and its "=", lengths [b]) for generation."""
    tokens = torch.full((len(problems), SEQ_LENGTH), PAD, dtype=torch.int64)
    lengths = torch.empty(len(problems), dtype=torch.int64)
    for i, p in enumerate(problems):
        ids = encode(p.prompt + "=")
        tokens[i, : len(ids)] = torch.tensor(ids)
        lengths[i] = len(ids)
    return tokens, lengths


MAX_ANSWER = 5  # digits plus the full stop: answers are below 1000
