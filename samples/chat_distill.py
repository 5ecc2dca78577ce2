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
    "volcanoes",
    "the moon",
    "bread",
    "rain",
    "bicycles",
    "the ocean",
    "honey",
    "trees",
    "computers",
    "the heart",
    "chess",
    "music",
    "electricity",
    "birds",
    "coffee",
    "the internet",
    "gardening",
    "mountains",
    "money",
    "sleep",
    "football",
    "glaciers",
    "photosynthesis",
    "the Roman empire",
    "recycling",
    "vaccines",
    "dinosaurs",
    "the stock market",
    "friendship",
    "cooking pasta",
    "learning a language",
    "time management",
]
TEMPLATES = [
    "What is {t}?",
    "Explain {t} to a child.",
    "Give me three facts about {t}.",
    "Write a short paragraph about {t}.",
    "Why is {t} important?",
    "Write a short poem about {t}.",
    "What are the pros and cons of {t}?",
    "Summarise what you know about {t} in a few sentences.",
]


def prompts() -> list[str]:
    return [tpl.format(t=t) for tpl in TEMPLATES for t in TOPICS]


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
