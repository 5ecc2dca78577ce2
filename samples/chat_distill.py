"""Distillation text for MTP heads on a chat model: the model's own greedy answers.

`python -m specport.samples.chat_distill --messages OUT.txt` writes only the messages (one per
paragraph) for `specport train-mtp ARTIFACT --chat --data OUT.txt`, which lets the artifact's
own base model answer them under its chat template (no Hugging Face directory needed).

`python -m specport.samples.chat_distill HF_DIR OUT.txt` asks the model (through transformers,
with its chat template) a few hundred templated questions and instructions - different from the
benchmark set in `chat_prompts.py` - and writes each greedy answer as one document of OUT.txt
(blank-line separated), the input `specport train-mtp --data` expects. The heads then learn to
predict how this model answers, which is what greedy speculative decoding must guess.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

logger = logging.getLogger(__name__)

TOPICS = [
    "volcanoes", "the moon", "bread", "rain", "bicycles", "the ocean", "honey", "trees",
    "computers", "the heart", "chess", "music", "electricity", "birds", "coffee", "the internet",
    "gardening", "mountains", "money", "sleep", "football", "glaciers", "photosynthesis",
    "the Roman empire", "recycling", "vaccines", "dinosaurs", "the stock market", "friendship",
    "cooking pasta", "learning a language", "time management",
    "earthquakes", "the sun", "cheese", "snow", "trains", "rivers", "bees", "forests",
    "smartphones", "the brain", "painting", "jazz", "magnets", "whales", "tea", "email",
    "cycling to work", "deserts", "banks", "exercise", "tennis", "hurricanes", "gravity",
    "ancient Egypt", "solar panels", "antibiotics", "fossils", "taxes", "kindness",
    "baking a cake", "studying for exams", "working from home", "the printing press", "rockets",
    "clouds", "salt", "libraries", "airplanes", "volunteering", "the human skeleton", "robots",
    "poetry", "batteries", "octopuses", "chocolate", "maps", "democracy", "bridges", "yoga",
    "the water cycle", "spiders", "pizza", "wind power", "the immune system", "video games",
    "saving money", "public speaking", "camping", "the Olympic games", "plastic pollution",
    "black holes", "coral reefs", "writing a resume", "a healthy breakfast",
]  # fmt: skip
TEMPLATES = [
    "What is {t}?",
    "Explain {t} to a child.",
    "Give me three facts about {t}.",
    "Write a short paragraph about {t}.",
    "Why is {t} important?",
    "Write a short poem about {t}.",
    "What are the pros and cons of {t}?",
    "Summarise what you know about {t} in a few sentences.",
    "How does {t} work?",
    "Tell me a short story about {t}.",
    "List five things people should know about {t}.",
    "Describe {t} in one paragraph.",
    "What would the world be like without {t}?",
    "Write a friendly email to a friend about {t}.",
    "Explain {t} step by step.",
    "What are common mistakes people make about {t}?",
]
# Paragraphs to rewrite (none of them is in the benchmark set of `chat_prompts.py`).
PARAGRAPHS = [
    "The library opens at nine in the morning and closes at six in the evening. Members can "
    "borrow up to five books for three weeks, and they can renew them online once. Late books "
    "cost ten cents a day, and lost books must be paid for at their full price.",
    "Tomatoes grow best in warm weather and need at least six hours of sun a day. Plant them "
    "after the last frost, water them deeply twice a week, and tie the stems to a stick as they "
    "grow. The fruit is ready when it is red and slightly soft.",
    "hello everyone, the school trip to the museum is next tuesday. the bus leaves at eight "
    "sharp from the main gate. bring a packed lunch, a notebook and a signed permission form, "
    "and wear comfortable shoes because we will walk a lot.",
    "Octopuses have three hearts and blue blood. They can change the colour of their skin in a "
    "fraction of a second to hide from danger, and each of their eight arms can taste what it "
    "touches. Most octopuses live only one or two years.",
    "The company was founded in a small garage in 1998 by two friends who wanted to make "
    "cheaper bicycles. Ten years later it had shops in twelve countries, and today it sells "
    "electric bikes, helmets and repair kits all over the world.",
    "Regular exercise strengthens the heart, improves sleep and lifts the mood. Adults should "
    "aim for about two and a half hours of moderate activity a week, such as brisk walking or "
    "cycling, plus some exercises that build muscle on two days.",
    "The Great Wall of China is not one wall but many walls built over about two thousand "
    "years. Its total length is more than twenty thousand kilometres, and most of the parts "
    "that visitors see today were built during the Ming dynasty.",
    "To reset your password, open the settings page and choose security. Click the reset "
    "button, enter the code we send to your phone, and pick a new password with at least "
    "twelve characters. You will be signed out of every other device.",
]
REWRITES = [
    "Summarise this paragraph in one sentence:\n{p}",
    "Rewrite this paragraph for a young child:\n{p}",
    "Turn this paragraph into a numbered list:\n{p}",
    "Fix the grammar and punctuation of this text:\n{p}",
    "Repeat this paragraph and add a title:\n{p}",
    "Rewrite this paragraph in a formal tone:\n{p}",
]


# The broader part of the collection: other kinds of request, other subjects and other texts
# to rewrite, so that a head trained on it meets more than 16 phrasings of a question.
MORE_TOPICS = [
    "the railway", "penguins", "the piano", "wool", "lighthouses", "the metric system",
    "rainbows", "volcanic islands", "umbrellas", "the alphabet", "milk", "a city park",
    "wolves", "the calendar", "soap", "tides", "owls", "fire", "the post office", "kites",
    "elephants", "glass", "paper", "the moon landing", "hiking", "sunscreen", "compost",
    "traffic lights", "the violin", "rice", "ants", "thunderstorms", "a first job interview",
    "learning to swim", "moving to a new city", "a birthday party", "the weekend",
    "a rainy day", "the library card", "a job in a bakery", "a small business", "a road trip",
    "the first day of school", "meditation", "drinking water", "cats", "dogs", "horses",
    "the desert fox", "ice cream", "the alarm clock", "the microwave oven", "a vegetable garden",
    "the night sky", "a budget", "online shopping", "passwords", "board games", "museums",
    "the seaside",
]  # fmt: skip
MORE_TEMPLATES = [
    "Can you tell me about {t}?",
    "I want to learn about {t}. Where should I start?",
    "Give me some tips about {t}.",
    "What is the history of {t}?",
    "Write a haiku about {t}.",
    "Write a limerick about {t}.",
    "Explain {t} in simple terms.",
    "Give me a fun fact about {t}.",
    "What are some myths about {t}?",
    "Write a short dialogue between two friends about {t}.",
    "Write three quiz questions about {t}, with the answers.",
    "How has {t} changed over the last hundred years?",
    "Write a short speech about {t}.",
    "What jobs have to do with {t}?",
    "Describe a day in the life of someone who works with {t}.",
    "Write a news headline and a short article about {t}.",
    "How would you explain {t} to someone from the year 1800?",
    "Write a diary entry about {t}.",
    "What should a beginner know about {t}?",
    "Is {t} good or bad? Give both sides.",
    "Write an advert for {t}.",
    "Write a thank-you note that mentions {t}.",
    "Make a short to-do list about {t}.",
    "Answer in one sentence: what is {t}?",
]
MORE_PARAGRAPHS = [
    "Our café is open from seven to three every day except Monday. We bake our bread each "
    "morning, and the soup changes every week. Dogs are welcome on the terrace, and we take "
    "cards and cash.",
    "dear parents, the swimming lessons start again on the fourth of may. children need a "
    "towel, a swimming cap and a bottle of water. the lesson lasts forty minutes and parents "
    "can watch from the gallery.",
    "The moon has no air and no liquid water. Its surface is covered in grey dust and craters "
    "made by rocks from space. Because it has no wind, the footprints left by astronauts in "
    "1969 are probably still there today.",
    "To plant a tree, dig a hole twice as wide as its roots and just as deep. Put the tree in "
    "the middle, fill the hole with soil, and press it down gently. Water the tree well every "
    "week during its first summer.",
    "The museum has three floors. The ground floor shows old tools and farm machines, the "
    "first floor has paintings from the town, and the top floor is for children, with games "
    "and a small theatre. Entry is free on Sundays.",
    "Please remember that the office will be closed on Friday for cleaning. The printers "
    "will be moved to the second floor, and the kitchen will get a new fridge. Take your food "
    "home on Thursday evening.",
    "Penguins cannot fly, but they are excellent swimmers. They use their wings like flippers "
    "and can dive deep to catch fish. Most penguins live in the southern half of the world, "
    "and some live on the ice of Antarctica all year.",
    "Before a long drive, check the tyres, the oil and the lights. Plan a stop every two "
    "hours, drink water, and never drive when you feel tired. Keep a phone charger and a "
    "blanket in the car in case of a breakdown.",
    "my brother and me went to the beach yesterday. we swims in the sea and ate ice cream, "
    "then it start raining so we run back to the car. it was a fun day anyway",
    "The town council will build a new cycle path along the river next spring. It will be "
    "four kilometres long and link the station to the university. Work starts in March and "
    "should be finished before the summer holidays.",
    "Green tea comes from the same plant as black tea. The leaves are heated soon after they "
    "are picked, which keeps them green. It has less caffeine than coffee, and many people "
    "drink it without milk or sugar.",
    "A good night's sleep helps the brain store what it learned during the day. Children need "
    "about ten hours, teenagers about nine and adults seven to eight. Screens in the bedroom "
    "make it harder to fall asleep.",
]
MORE_REWRITES = [
    "Summarise this text:\n{p}",
    "Make this text shorter:\n{p}",
    "Rewrite this text so that it is easier to read:\n{p}",
    "Put this text into bullet points:\n{p}",
    "Correct the mistakes in this text:\n{p}",
    "Write this text again as a short poem:\n{p}",
    "What is the main idea of this text?\n{p}",
    "Ask three questions about this text:\n{p}",
    "Give this text a title:\n{p}",
    "Rewrite this text as if you were talking to a friend:\n{p}",
]
CORE = 768  # the first part of the collection, unchanged since the collection had only it


def prompts() -> list[str]:
    """Every message, in a fixed shuffled order: `--sequences N` (the first N) then covers
    every kind of question and rewriting task, not only the first templates.

    The first ``CORE`` are the first collection's (16 question templates over 96 subjects and
    6 rewrites of 8 texts), in the order they always had, so training data of ``--sequences
    768`` is what it was; the rest mixes those with the broader set (``MORE_*``): 24 other
    kinds of request, 60 more subjects and 10 rewrites of 20 texts."""
    import random

    first = [tpl.format(t=t) for tpl in TEMPLATES for t in TOPICS]
    first += [tpl.format(p=p) for tpl in REWRITES for p in PARAGRAPHS]
    random.Random(0).shuffle(first)
    topics = TOPICS + MORE_TOPICS
    rest = first[CORE:]
    rest += [tpl.format(t=t) for tpl in TEMPLATES for t in MORE_TOPICS]
    rest += [tpl.format(t=t) for tpl in MORE_TEMPLATES for t in topics]
    rest += [tpl.format(p=p) for tpl in REWRITES for p in MORE_PARAGRAPHS]
    rest += [tpl.format(p=p) for tpl in MORE_REWRITES for p in PARAGRAPHS + MORE_PARAGRAPHS]
    random.Random(1).shuffle(rest)
    return first[:CORE] + rest


def main(argv: list[str] | None = None) -> int:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", help="Hugging Face model directory with a chat template")
    ap.add_argument("out", nargs="?", help="text file to write (one answer per paragraph)")
    ap.add_argument("--messages", metavar="OUT", help="write only the messages to OUT and stop")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--limit", type=int, default=0, help="use only the first N prompts")
    args = ap.parse_args(argv)
    if args.messages:
        target = Path(args.messages)
        if target.exists():
            raise SystemExit(f"{target} exists; choose another path.")
        target.write_text("\n\n".join(prompts()[: args.limit or None]) + "\n", encoding="utf-8")
        return 0
    if not (args.model and args.out):
        ap.error("give MODEL and OUT, or --messages OUT")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    tok = AutoTokenizer.from_pretrained(args.model)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    texts = prompts()[: args.limit or None]
    out = Path(args.out)
    if out.exists():
        raise SystemExit(f"{out} exists; choose another path.")
    docs = []
    for i in range(0, len(texts), args.batch):
        chats = [
            tok.apply_chat_template(
                [{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True
            )
            for t in texts[i : i + args.batch]
        ]
        enc = tok(chats, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            gen = model.generate(**enc, do_sample=False, max_new_tokens=args.new_tokens)
        for row in gen[:, enc["input_ids"].shape[1] :]:
            text = str(tok.decode(row, skip_special_tokens=True)).strip().replace("\n\n", "\n")
            if text:
                docs.append(text)
        logger.info("%d/%d answers", len(docs), len(texts))
    out.write_text("\n\n".join(docs) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
