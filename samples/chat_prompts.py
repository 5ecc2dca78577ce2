"""A fixed set of 16 varied chat prompts for benchmarks on instruction-tuned models.

Three kinds, because speculative methods win in different places: questions and instructions
(free-form answers: what MTP heads and draft models must guess) and rewriting or summarising a
given paragraph (the answer copies spans of the prompt: where n-gram lookup helps). Each is a
single user turn; the bench renders it with the artifact's chat template.
"""

from __future__ import annotations

PARAGRAPH_BEES = (
    "Honey bees live in colonies of up to sixty thousand workers, one queen and a few hundred "
    "drones. Workers gather nectar and pollen from flowers, turn the nectar into honey, and store "
    "it in wax cells for the winter. A worker bee lives about six weeks in summer, while the "
    "queen can live for several years and lays up to two thousand eggs a day."
)
PARAGRAPH_TRAIN = (
    "The first public railway to use steam locomotives opened in 1825 between Stockton and "
    "Darlington in the north of England. It carried coal from the mines to the river, and soon "
    "passengers as well. Within twenty years railways linked most large cities in Britain, and "
    "travel times that had taken days by coach fell to a few hours."
)
PARAGRAPH_EMAIL = (
    "hi team, the meeting on thursday is moved to friday at 10am because the room is booked. "
    "please bring the sales numbers for march and april and the draft of the new price list. "
    "if you cannot come tell me before wednesday so i can send you the notes after."
)
PARAGRAPH_PYTHON = (
    "Python is a programming language that is easy to read and easy to learn. It is used for "
    "web development, data analysis, machine learning and automating everyday tasks. Python "
    "code uses indentation to mark blocks, and it comes with a large standard library."
)

CHAT_PROMPTS: list[dict[str, str]] = [
    {"kind": "question", "text": "What is the capital of France?"},
    {"kind": "question", "text": "Why is the sky blue?"},
    {"kind": "question", "text": "How do plants make their food?"},
    {"kind": "question", "text": "What are the main differences between a cat and a dog as pets?"},
    {"kind": "question", "text": "What causes the seasons on Earth?"},
    {"kind": "instruction", "text": "Write a haiku about the sea."},
    {"kind": "instruction", "text": "Give me three tips for sleeping better."},
    {"kind": "instruction", "text": "Write a short story about a robot who learns to paint."},
    {"kind": "instruction", "text": "Explain how to make a cup of tea, step by step."},
    {
        "kind": "instruction",
        "text": "Write a polite email asking my neighbour to turn down the music.",
    },
    {"kind": "rewrite", "text": f"Summarise this paragraph in two sentences:\n\n{PARAGRAPH_BEES}"},
    {"kind": "rewrite", "text": f"Rewrite this paragraph in simpler words:\n\n{PARAGRAPH_TRAIN}"},
    {
        "kind": "rewrite",
        "text": f"Fix the capitalisation and punctuation of this email:\n\n{PARAGRAPH_EMAIL}",
    },
    {
        "kind": "rewrite",
        "text": f"Repeat this paragraph, then give it a title:\n\n{PARAGRAPH_PYTHON}",
    },
    {"kind": "rewrite", "text": f"Turn this paragraph into a bulleted list:\n\n{PARAGRAPH_BEES}"},
    {"kind": "rewrite", "text": f"Rewrite this paragraph in the past tense:\n\n{PARAGRAPH_PYTHON}"},
]


PARAGRAPH_GARDEN = (
    "The community garden on Elm Street has forty small plots. Anyone who lives nearby can rent "
    "one for a year. Tools are kept in the green shed, the water is free, and there is a "
    "meeting on the first Saturday of every month to plan the work."
)
PARAGRAPH_NOTICE = (
    "dear customers, from next monday the shop will open at 9 instead of 8. we are sorry for "
    "any trouble. the bakery counter stays the same and you can still order cakes by phone "
    "or on our website"
)
PARAGRAPH_SALT = (
    "Salt was once so valuable that it was used as money. Roman soldiers were sometimes paid "
    "with it, and cities grew up along the roads that carried it. Today most salt comes from "
    "mines or from drying sea water in shallow pools."
)

# A second set of 16, for checking that a drafter tuned on the first set also pays on
# requests it has not seen: the same three kinds, other wording, other texts. Neither set is
# in the training collection of ``samples.chat_distill``.
MORE_CHAT_PROMPTS: list[dict[str, str]] = [
    {"kind": "question", "text": "How many legs does a spider have?"},
    {"kind": "question", "text": "Why do leaves change colour in autumn?"},
    {"kind": "question", "text": "What is the difference between weather and climate?"},
    {"kind": "question", "text": "How does a refrigerator keep food cold?"},
    {"kind": "question", "text": "Who invented the telephone, and when?"},
    {"kind": "instruction", "text": "Write a four-line poem about a lost umbrella."},
    {"kind": "instruction", "text": "Suggest a name for a small bakery and explain why."},
    {"kind": "instruction", "text": "Give me a simple recipe for pancakes."},
    {"kind": "instruction", "text": "Write a short message thanking a teacher."},
    {"kind": "instruction", "text": "Describe a sunset to someone who has never seen one."},
    {"kind": "rewrite", "text": f"Summarise this in one sentence:\n\n{PARAGRAPH_GARDEN}"},
    {"kind": "rewrite", "text": f"Make this notice polite and correct:\n\n{PARAGRAPH_NOTICE}"},
    {"kind": "rewrite", "text": f"Explain this paragraph to a child:\n\n{PARAGRAPH_SALT}"},
    {"kind": "rewrite", "text": f"List the facts in this paragraph:\n\n{PARAGRAPH_GARDEN}"},
    {"kind": "rewrite", "text": f"Rewrite this in the future tense:\n\n{PARAGRAPH_SALT}"},
    {"kind": "rewrite", "text": f"Give this notice a subject line:\n\n{PARAGRAPH_NOTICE}"},
]


def chat_prompts(kind: str | None = None, *, more: bool = False) -> list[str]:
    """The prompt texts, all or only one kind (question | instruction | rewrite), of the
    benchmark set or (``more``) of the second set."""
    rows = MORE_CHAT_PROMPTS if more else CHAT_PROMPTS
    return [p["text"] for p in rows if kind is None or p["kind"] == kind]
