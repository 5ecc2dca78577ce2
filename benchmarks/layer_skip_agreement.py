"""Whether a model drafts for itself with a layer left out (self-speculation by layer
skipping, untrained): for each middle layer, the share of the model's own greedy answer tokens
that the model without that layer predicts, teacher-forced, in PyTorch (fp32). A draft whose
agreement is far below the quantized self draft's (0.97 on SmolLM2) cannot pay for the
layer it saves. Usage:

    python -m benchmarks.layer_skip_agreement GGUF ANSWERS.json

ANSWERS.json: a list of {"category", "plen", "ids"} (prompt ids followed by the model's plain
greedy answer), e.g. written by `python -m benchmarks.layer_skip_agreement --answers ARTIFACT
--prompts FILE --out ANSWERS.json`.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np

from specport.core.errors import SpecportError


def write_answers(artifact: str, prompts: str, limit: int, out: str) -> None:
    """The artifact's plain greedy answers (128 tokens) to a prompt file's first turns."""
    import specport
    from benchmarks.draft_ceiling import greedy_answers
    from specport.bench.prompt_sets import PromptFileChoice, file_prompts, read_choice

    model = specport.load(artifact)
    records, _ = read_choice(PromptFileChoice(prompts, limit=limit))
    rows = [
        {"category": bp.category, "plen": len(bp.ids), "ids": list(bp.ids) + answer}
        for bp, answer in greedy_answers(model, file_prompts(model, model, records, 128)[0])
    ]
    Path(out).write_text(json.dumps(rows))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("source", help="GGUF file (or, with --answers, the artifact)")
    ap.add_argument("answers", nargs="?", help="ANSWERS.json")
    ap.add_argument("--answers", dest="make", action="store_true", help="write ANSWERS.json")
    ap.add_argument("--prompts")
    ap.add_argument("--prompts-limit", type=int, default=1)
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.make:
        if not (args.prompts and args.out):
            ap.error("--answers needs --prompts FILE and --out ANSWERS.json")
        if Path(args.out).exists():
            ap.error(f"{args.out} exists; name a new file")
        try:
            write_answers(args.source, args.prompts, args.prompts_limit, args.out)
        except SpecportError as e:
            ap.error(str(e))
        return
    if not args.answers or not Path(args.answers).is_file() or not Path(args.source).is_file():
        ap.error("give the GGUF file and an ANSWERS.json made with --answers")
    import torch
    from transformers import AutoModelForCausalLM

    from specport.exporter.gguf_import import save_gguf_as_hf

    rows = json.loads(Path(args.answers).read_text())
    with tempfile.TemporaryDirectory() as tmp:
        save_gguf_as_hf(Path(args.source), Path(tmp), progress=False)
        model = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
    layers = model.model.layers

    def agreement(keep: list[int]) -> float:
        model.model.layers = torch.nn.ModuleList([layers[i] for i in keep])
        model.config.num_hidden_layers = len(keep)
        ok = total = 0
        with torch.no_grad():
            for row in rows:
                logits = model(torch.tensor([row["ids"]]), use_cache=False).logits[0]
                guess = logits[row["plen"] - 1 : -1].argmax(-1).numpy()
                answer = np.asarray(row["ids"][row["plen"] :])
                ok += int((guess == answer).sum())
                total += len(answer)
        model.model.layers, model.config.num_hidden_layers = layers, len(layers)
        return ok / total

    n = len(layers)
    print(f"all {n} layers: {agreement(list(range(n))):.3f}")
    for skipped in range(1, n - 1):
        print(f"without layer {skipped}: {agreement([i for i in range(n) if i != skipped]):.3f}")


if __name__ == "__main__":
    main()
