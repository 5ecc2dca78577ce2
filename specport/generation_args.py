"""Checks of `Model.generate` / `generate_batch` arguments, in the caller's own terms.

They run before any onnxruntime call, so a Python caller reads `max_new_tokens must be ...`
and a CLI user `--max-new-tokens must be ...` (see `specport.core.options`), and what depends on
the artifact (a tokenizer for text prompts, MTP heads, a tree-mask input) is checked against
its manifest here rather than failing deep in the runtime.
"""

from __future__ import annotations

from collections.abc import Sequence
from numbers import Integral
from typing import Any

from specport.core.errors import InputError, UsageError
from specport.core.options import option

METHODS = ("ngram", "suffix", "draft", "mtp", "eagle", "auto")  # as runtime/speculative/loop.py
MAX_DRAFT = 16  # as runtime/speculative/loop.py, which cannot import this layer
DEFAULT_NUM_DRAFT = 4
AUTO_NUM_DRAFT = 16  # --speculative auto: its cap; 8 unless the prompt copies well (prompt_profile)


def _int_in(name: str, value: Any, low: int, high: int | None = None) -> int:
    number = int(value) if isinstance(value, Integral) and not isinstance(value, bool) else None
    ok = number is not None and number >= low
    if ok and high is not None:
        ok = number is not None and number <= high
    if not ok:
        span = f"in {low}..{high}" if high is not None else f">= {low}"
        raise UsageError(f"{option(name)} must be an integer {span}, got {value!r}.")
    return int(value)


def check_prompts(
    model: Any, prompts: Sequence[str] | None, prompt_ids: Sequence[Sequence[int]] | None
) -> None:
    if (prompts is None) == (prompt_ids is None):
        raise UsageError(
            f"give exactly one of {option('prompt')} (text) or {option('prompt_ids')} (token ids)."
        )
    if prompts is not None:
        if isinstance(prompts, str) or not prompts:
            raise UsageError(f"{option('prompt')} must be a non-empty list of strings.")
        if model.tokenizer is None:
            raise InputError(
                f"{model.path} has no tokenizer, so it cannot read text; pass token ids with "
                f"{option('prompt_ids')} instead."
            )
        for p in prompts:
            if not isinstance(p, str) or not p:
                raise UsageError(
                    f"every {option('prompt')} must be non-empty text, got {p!r}; pass some "
                    f"text (or token ids with {option('prompt_ids')})."
                )
        return
    assert prompt_ids is not None
    if not prompt_ids:
        raise UsageError(f"{option('prompt_ids')} is empty; give at least one prompt.")
    vocab = model.manifest.vocab_size
    for row in prompt_ids:
        if not len(row):
            raise UsageError(f"every {option('prompt_ids')} row needs at least one token id.")
        bad = [
            t for t in row if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab
        ]
        if bad:
            raise UsageError(
                f"{option('prompt_ids')} holds {bad[:5]}, outside this model's vocabulary "
                f"(integers 0..{vocab - 1})."
            )


def resolve_num_draft(model: Any, speculative: str | None, num_draft: int | None) -> int:
    """The draft length: as given, else what fits the method (all of an MTP artifact's heads)."""
    heads = int((model.manifest.mtp or {}).get("heads") or 0)
    if num_draft is None:
        if speculative == "auto":  # it sizes each step's drafts itself, up to this
            return AUTO_NUM_DRAFT
        return heads if speculative == "mtp" and heads else DEFAULT_NUM_DRAFT
    _int_in("num_draft", num_draft, 1, MAX_DRAFT)
    if speculative == "mtp" and heads and num_draft > heads:
        raise UsageError(
            f"{option('num_draft', num_draft)} is more than the artifact's {heads} MTP heads; "
            f"use 1..{heads} (or leave it out: the default is all heads)."
        )
    return int(num_draft)


# the methods whose drafts can form a token tree (--tree-width > 1)
TREE_METHODS = ("ngram", "mtp", "eagle")


def check_generation(
    model: Any,
    *,
    max_new_tokens: int,
    speculative: str | None,
    draft: Any,
    tree_width: int = 1,
    batch: int = 1,
) -> None:
    from specport.core.contract import MAX_TREE_WIDTH  # numpy: loaded with the model already

    _int_in("max_new_tokens", max_new_tokens, 1)
    _int_in("tree_width", tree_width, 1, MAX_TREE_WIDTH)
    if speculative is not None and speculative not in METHODS:
        raise UsageError(
            f"unknown {option('speculative', speculative)}; choose one of {', '.join(METHODS)}."
        )
    if tree_width != 1:
        if speculative not in TREE_METHODS:
            raise UsageError(
                f"{option('tree_width')} needs {option('speculative', 'ngram')}, "
                f"{option('speculative', 'mtp')} or {option('speculative', 'eagle')} (tree "
                "candidates come from n-gram matches, the MTP heads or the EAGLE head)."
            )
        if batch != 1:
            raise UsageError(f"{option('tree_width')} runs one prompt at a time; pass one prompt.")
    if speculative == "draft" and draft is None:
        raise UsageError(
            f"{option('speculative', 'draft')} needs a draft artifact: pass {option('draft')} "
            "(e.g. one made with `specport export MODEL --layers 2 --out DRAFT`)."
        )
    if draft is not None and speculative not in ("draft", "auto"):
        raise UsageError(
            f"{option('draft')} is used only with {option('speculative', 'draft')} (or auto); add it or "
            f"drop {option('draft')}."
        )
    if speculative == "eagle" and not model.manifest.extra.get("eagle"):
        raise InputError(
            f"{model.path} has no EAGLE draft head. Train one with `specport train-draft "
            f"{model.path} --out DIR` and run DIR, or use {option('speculative', 'ngram')}."
        )
    if speculative == "mtp" and not (model.manifest.mtp or {}).get("heads"):
        raise InputError(
            f"{model.path} has no MTP heads. Train them with `specport train-mtp "
            f"{model.path} --data FILE --out DIR` and run DIR, or use "
            f"{option('speculative', 'ngram')}."
        )


def sampling_config(
    greedy: bool | None,
    temperature: float,
    top_k: int,
    top_p: float,
    min_p: float,
    repetition_penalty: float,
    seed: int | None,
) -> Any:
    """The `SamplingConfig` the separate sampling arguments describe, validated. `greedy` None:
    greedy exactly when every other argument is left at its default."""
    from specport.runtime.sampler import SamplingConfig

    if greedy is None:
        greedy = (
            temperature == 1.0 and top_k == 0 and top_p == 1.0 and min_p == 0.0 and seed is None
        )
    config = SamplingConfig(
        greedy=greedy,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        repetition_penalty=repetition_penalty,
        seed=seed,
    )
    config.validate()
    return config


def check_speculative_sampling(config: Any, tree_width: int) -> None:
    """What one-prompt speculative decoding cannot honour of a `SamplingConfig`."""
    if config.presence_penalty or config.frequency_penalty or config.logit_bias:
        raise UsageError(
            "presence / frequency penalties and logit_bias are not supported with "
            "speculative decoding; use repetition_penalty, or decode without it."
        )
    if config.constraint is not None and (not config.greedy or tree_width != 1):
        raise UsageError(
            "structured outputs (a grammar) with speculative decoding need greedy "
            "decoding (temperature 0) and chain drafts (tree width 1); decode without "
            "--speculative for sampled constrained requests."
        )
