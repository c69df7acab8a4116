"""A small synthetic conversational language with real structure (counting, copying, reversing,
arithmetic, spelling, templated facts), so a tiny target's greedy answers are predictable from
context and a drafter has something to learn. Deterministic for a given seed."""

from __future__ import annotations

import random

WORDS = (
    "apple river stone cloud green blue red yellow tree house bird fish moon sun star light "
    "dark cold warm fast slow small big old new door road hill lake rain snow wind fire"
).split()
COLORS = {"sky": "blue", "grass": "green", "sun": "yellow", "snow": "white", "night": "black", "fire": "red"}
ANIMALS = {"dog": "bark", "cat": "meow", "cow": "moo", "duck": "quack", "lion": "roar", "owl": "hoot"}


def _num(n: int) -> str:
    return " ".join(str(n))  # digits are separate tokens: arithmetic stays learnable


# Task mix: mostly structured answers (counting, templates, arithmetic) that a target answers
# the same way every time, with some copying tasks that need attention to the prompt.
TASK_WEIGHTS = (35, 8, 6, 12, 9, 15, 15)  # count, repeat, reverse, add, spell, color, animal


def make_example(rng: random.Random) -> tuple[str, str]:
    kind = rng.choices(range(7), weights=TASK_WEIGHTS)[0]
    if kind == 0:
        a = rng.randrange(0, 40)
        b = a + rng.randrange(5, 16)
        return f"count from {_num(a)} to {_num(b)}", " , ".join(_num(i) for i in range(a, b + 1)) + " ."
    if kind == 1:
        seq = rng.choices(WORDS, k=rng.randrange(3, 7))
        return "repeat twice : " + " ".join(seq), " ".join(seq) + " ; " + " ".join(seq) + " ."
    if kind == 2:
        seq = rng.choices(WORDS, k=rng.randrange(3, 7))
        return "reverse : " + " ".join(seq), " ".join(reversed(seq)) + " ."
    if kind == 3:
        a, b = rng.randrange(0, 50), rng.randrange(0, 50)
        return f"add {_num(a)} and {_num(b)}", f"{_num(a)} plus {_num(b)} equals {_num(a + b)} ."
    if kind == 4:
        w = rng.choice(WORDS)
        return f"spell {w}", f"the word {w} is spelled " + " - ".join(w) + " ."
    if kind == 5:
        thing = rng.choice(sorted(COLORS))
        return (
            f"what color is the {thing}",
            f"the {thing} is {COLORS[thing]} . the color of the {thing} is {COLORS[thing]} .",
        )
    animal = rng.choice(sorted(ANIMALS))
    n = rng.randrange(2, 5)
    return f"what does the {animal} say {_num(n)} times", f"the {animal} says " + " ".join([ANIMALS[animal]] * n) + " ."


def make_conversations(n: int, seed: int) -> list[list[dict[str, str]]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        messages = [{"role": "system", "content": "you are a helpful assistant ."}]
        for _turn in range(rng.randrange(1, 3)):
            user, assistant = make_example(rng)
            messages += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
        out.append(messages)
    return out


def corpus_words() -> list[str]:
    """Every word the language can produce (for the word-level tokenizer)."""
    words = set(WORDS) | set(COLORS) | set(COLORS.values()) | set(ANIMALS) | set(ANIMALS.values())
    words |= set("0123456789")
    words |= set("abcdefghijklmnopqrstuvwxyz")
    words |= set(
        "count from to repeat twice reverse add and plus equals spell the word is spelled what color "
        "of does say says times you are a helpful assistant , . ; : -".split()
    )
    return sorted(words)
