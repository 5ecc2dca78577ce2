"""A seeded synthetic corpus of tiny stories for the built-in demo model.

`specport demo` must work offline, with no download, on a laptop CPU. A small grammar (names,
animals, objects, adjectives, places, a dozen sentence templates) gives text that a ~1M-parameter
model learns in about a minute, so its greedy output reads as English and speculative decoding
on it shows real acceptance rates. The same seed always gives the same corpus.
"""

from __future__ import annotations

import random

NAMES = ["Lily", "Tom", "Mia", "Ben", "Sam", "Anna", "Max", "Lucy", "Tim", "Sue"]
ANIMALS = ["cat", "dog", "bird", "fish", "frog", "duck", "bunny", "bear", "fox", "mouse"]
GIRLS = ("Lily", "Mia", "Anna", "Lucy", "Sue")
OBJECTS = [
    "ball",
    "kite",
    "box",
    "hat",
    "book",
    "cake",
    "toy",
    "car",
    "boat",
    "apple",
    "flower",
    "drum",
]
ADJECTIVES = [
    "big",
    "small",
    "red",
    "blue",
    "green",
    "happy",
    "little",
    "shiny",
    "soft",
    "old",
    "funny",
    "yellow",
]
PLACES = ["park", "garden", "house", "forest", "school", "river", "yard", "shop"]
FEELINGS = ["happy", "sad", "glad", "scared", "tired", "proud", "excited", "sleepy"]
ACTIONS = ["play", "run", "jump", "sing", "dance", "read", "swim", "draw"]
TAKE_VERBS = ["found", "saw", "liked", "had", "wanted", "made", "lost", "got"]
TIMES = ["One day", "Then", "After that", "Later", "In the morning", "At night"]


def _a(word: str) -> str:
    """The indefinite article for `word`."""
    return "an" if word[0] in "aeiou" else "a"


def _np(rng: random.Random, nouns: list[str]) -> str:
    """A noun phrase with an optional adjective: 'the red ball' or 'a ball'."""
    noun = rng.choice(nouns)
    if rng.random() < 0.6:
        noun = f"{rng.choice(ADJECTIVES)} {noun}"
    return f"{_a(noun)} {noun}" if rng.random() < 0.5 else f"the {noun}"


def _story(rng: random.Random) -> str:
    """A short story of 3-6 sentences about one character."""
    name = rng.choice(NAMES)
    girl = name in GIRLS
    kind = rng.choice(["girl" if girl else "boy", *ANIMALS])
    pronoun = "she" if girl else "he"
    adj = rng.choice(ADJECTIVES)
    opening = rng.choice(
        [
            f"Once upon a time, there was {_a(adj)} {adj} {kind} named {name}.",
            f"Once upon a time, {name} the {kind} lived near the {rng.choice(PLACES)}.",
            f"There was a {kind} named {name}.",
        ]
    )
    sentences = [opening]
    templates = [
        lambda: f"{name} liked to {rng.choice(ACTIONS)} in the {rng.choice(PLACES)}.",
        lambda: f"{rng.choice(TIMES)}, {name} {rng.choice(TAKE_VERBS)} {_np(rng, OBJECTS)}.",
        lambda: f"{pronoun.capitalize()} was very {rng.choice(FEELINGS)}.",
        lambda: f"{name} went to the {rng.choice(PLACES)} with {_np(rng, ANIMALS)}.",
        lambda: f"The {rng.choice(ANIMALS)} wanted to {rng.choice(ACTIONS)} with {name}.",
        lambda: f"{pronoun.capitalize()} gave {_np(rng, OBJECTS)} to {rng.choice(NAMES)}.",
        lambda: f'"I like {_np(rng, OBJECTS)}," said {name}.',
        lambda: "They played together all day.",
        lambda: f"{name} and {rng.choice(NAMES)} were friends.",
    ]
    for _ in range(rng.randint(1, 4)):
        sentences.append(rng.choice(templates)())
    sentences.append(
        rng.choice(
            [
                f"{name} was {rng.choice(FEELINGS)} and went home.",
                "The end.",
                f"{pronoun.capitalize()} smiled and said thank you.",
                "They were best friends forever.",
            ]
        )
    )
    return " ".join(sentences)


def generate_corpus(n_docs: int, seed: int = 0) -> list[str]:
    """`n_docs` short stories (3-6 sentences each), identical for identical arguments."""
    if n_docs < 0:
        raise ValueError(f"n_docs must be >= 0, got {n_docs}")
    rng = random.Random(seed)
    return [_story(rng) for _ in range(n_docs)]
