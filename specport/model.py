"""`Model`: a loaded artifact and what it does - tokens <-> text, plain and speculative generation.

`specport.loading.load` builds one; `specport.api` re-exports it. The session state (manifest,
onnxruntime session, tokenizer, suffix index, the KV kept between calls) is the base class's,
`specport.loaded.LoadedArtifact`; this adds the public signatures. The argument checks live in
`specport.generation_args` and the decoding loops behind `specport.plain_calls` and
`specport.speculative_calls`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any, Literal, overload

from specport import generation_args as checks
from specport.core.errors import UsageError
from specport.core.options import option
from specport.loaded import LoadedArtifact
from specport.plain_calls import plain_batch
from specport.results import GenerationResult
from specport.self_draft import ensure_self_draft, is_self
from specport.speculative_calls import speculative_batch, speculative_one
from specport.text_stream import TextStream


class Model(LoadedArtifact):
    """A loaded artifact: manifest, onnxruntime session, tokenizer, and generation."""

    # ---- what speculation needs resolved before it starts --------------------------------
    def draft_model(self, draft: Model | str | os.PathLike[str] | None) -> Model | None:
        """The draft model for speculative="draft": a path is loaded once, on this model's
        provider, threads and spinning: opened with defaults it took a pool of one thread per
        core beside the target's, so a target given 4 of 8 cores drafted on 8. The runtime's
        engines call this rather than load an artifact themselves. "self": the target's own
        4-bit file, made once and cached (`specport.self_draft`)."""
        if not isinstance(draft, (str, os.PathLike)):
            return draft
        if is_self(draft):
            draft = ensure_self_draft(self.path, self.manifest)
        config = self.session_config
        if config is None:
            return Model.open(draft, provider=self.provider)
        return Model.open(
            draft,
            provider=self.provider,
            threads=config.intra_op_threads,
            allow_spinning=config.resolved_spinning(),
        )

    def num_draft_for(self, speculative: str | None, num_draft: int | None) -> int:
        """The draft length for `speculative`: as given (checked), else what fits the method
        (all of an MTP artifact's heads)."""
        return checks.resolve_num_draft(self, speculative, num_draft)

    # ---- generation ------------------------------------------------------------------
    @overload
    def generate(
        self,
        prompt: str | None = None,
        *,
        stream: Literal[False] = False,
        prompt_ids: Sequence[int] | None = None,
        max_new_tokens: int = 64,
        greedy: bool | None = None,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        min_p: float = 0.0,
        repetition_penalty: float = 1.0,
        seed: int | None = None,
        ignore_eos: bool = False,
        stop: Sequence[str] = (),
        on_text: Callable[[str], None] | None = None,
        speculative: str | None = None,
        num_draft: int | None = None,
        draft: Model | str | os.PathLike[str] | None = None,
        adaptive: bool | None = None,
        tree_width: int = 1,
        sampling: Any = None,
    ) -> GenerationResult: ...

    @overload
    def generate(
        self,
        prompt: str | None = None,
        *,
        stream: Literal[True],
        prompt_ids: Sequence[int] | None = None,
        max_new_tokens: int = 64,
        greedy: bool | None = None,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        min_p: float = 0.0,
        repetition_penalty: float = 1.0,
        seed: int | None = None,
        ignore_eos: bool = False,
        stop: Sequence[str] = (),
        on_text: Callable[[str], None] | None = None,
        speculative: str | None = None,
        num_draft: int | None = None,
        draft: Model | str | os.PathLike[str] | None = None,
        adaptive: bool | None = None,
        tree_width: int = 1,
        sampling: Any = None,
    ) -> TextStream: ...

    def generate(
        self,
        prompt: str | None = None,
        *,
        stream: bool = False,
        prompt_ids: Sequence[int] | None = None,
        max_new_tokens: int = 64,
        greedy: bool | None = None,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        min_p: float = 0.0,
        repetition_penalty: float = 1.0,
        seed: int | None = None,
        ignore_eos: bool = False,
        stop: Sequence[str] = (),
        on_text: Callable[[str], None] | None = None,
        speculative: str | None = None,
        num_draft: int | None = None,
        draft: Model | str | os.PathLike[str] | None = None,
        adaptive: bool | None = None,
        tree_width: int = 1,
        sampling: Any = None,
    ) -> GenerationResult | TextStream:
        """Generate for one prompt (text or ids). `on_text` receives text as it is produced;
        `stream=True` returns a `TextStream` instead: iterate it for the text pieces, then read
        its `.result`.

        `speculative` ("ngram" | "draft" | "mtp") drafts `num_draft` tokens per step and verifies
        them in one run of this model; greedy output is token-for-token that of plain greedy.
        `adaptive` picks the draft length per step from recent acceptance (None: per-method default).
        `tree_width` > 1 (ngram, mtp or eagle; artifact exported with `--tree-mask`) verifies
        that many candidate continuations at once as a token tree. `num_draft` None: all of an MTP
        artifact's heads, else 4. `sampling` (a `SamplingConfig`, e.g. with OpenAI's presence /
        frequency penalties or a logit bias) replaces the separate sampling arguments.
        """
        checks.check_prompts(
            self,
            None if prompt is None else [prompt],
            None if prompt_ids is None else [list(prompt_ids)],
        )
        checks.check_generation(
            self,
            max_new_tokens=max_new_tokens,
            speculative=speculative,
            draft=draft,
            tree_width=tree_width,
        )
        num_draft = checks.resolve_num_draft(self, speculative, num_draft)
        if stream:
            if on_text is not None:
                raise UsageError(f"give {option('on_text')} or {option('stream', True)}, not both.")
            options: dict[str, Any] = {
                "prompt_ids": prompt_ids,
                "max_new_tokens": max_new_tokens,
                "greedy": greedy,
                "temperature": temperature,
                "top_k": top_k,
                "top_p": top_p,
                "min_p": min_p,
                "repetition_penalty": repetition_penalty,
                "seed": seed,
                "ignore_eos": ignore_eos,
                "stop": stop,
                "speculative": speculative,
                "num_draft": num_draft,
                "draft": draft,
                "adaptive": adaptive,
                "tree_width": tree_width,
                "sampling": sampling,
            }
            return TextStream(lambda push: self.generate(prompt, on_text=push, **options))
        if speculative is not None:
            ids_one = list(prompt_ids) if prompt_ids is not None else self.encode(str(prompt))
            config = sampling or checks.sampling_config(
                greedy, temperature, top_k, top_p, min_p, repetition_penalty, seed
            )
            checks.check_speculative_sampling(config, tree_width)
            return speculative_one(
                self,
                ids_one,
                max_new_tokens=max_new_tokens,
                sampling=config,
                ignore_eos=ignore_eos,
                stop=stop,
                on_text=on_text,
                method=speculative,
                num_draft=num_draft,
                draft=self.draft_model(draft),
                adaptive=adaptive,
                tree_width=tree_width,
            )
        prompts = [prompt] if prompt is not None else None
        ids = [list(prompt_ids)] if prompt_ids is not None else None
        row_text = (lambda row, piece: on_text(piece)) if on_text else None
        return self.generate_batch(
            prompts,
            prompt_ids=ids,
            max_new_tokens=max_new_tokens,
            greedy=greedy,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            repetition_penalty=repetition_penalty,
            seed=seed,
            ignore_eos=ignore_eos,
            stop=stop,
            on_text=row_text,
            sampling=sampling,
        )[0]

    def generate_batch(
        self,
        prompts: Sequence[str] | None = None,
        *,
        prompt_ids: Sequence[Sequence[int]] | None = None,
        max_new_tokens: int = 64,
        greedy: bool | None = None,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        min_p: float = 0.0,
        repetition_penalty: float = 1.0,
        seed: int | None = None,
        ignore_eos: bool = False,
        stop: Sequence[str] = (),
        on_text: Callable[[int, str], None] | None = None,
        speculative: str | None = None,
        num_draft: int | None = None,
        draft: Model | str | os.PathLike[str] | None = None,
        adaptive: bool | None = None,
        sampling: Any = None,
    ) -> list[GenerationResult]:
        """Generate for several prompts at once (left padding, per-row stopping).

        With `speculative` the rows are drafted and verified together (one batched run per step);
        greedy output equals plain greedy for every row. Each result's metrics count its own
        prompt and new tokens (`prompt_tokens`, `new_tokens`); the timings and the
        `batch_prompt_tokens` / `batch_new_tokens` totals are the batch's.
        """
        if prompt_ids is not None and not isinstance(prompt_ids, (str, bytes)):
            prompt_ids = [list(p) for p in prompt_ids]
        checks.check_prompts(self, prompts, prompt_ids)
        checks.check_generation(
            self,
            max_new_tokens=max_new_tokens,
            speculative=speculative,
            draft=draft,
            batch=len(prompts or prompt_ids or []),
        )
        num_draft = checks.resolve_num_draft(self, speculative, num_draft)
        if prompt_ids is not None:
            rows = [[int(t) for t in p] for p in prompt_ids]
        else:
            assert prompts is not None
            rows = [self.encode(p) for p in prompts]
        config = sampling or checks.sampling_config(
            greedy, temperature, top_k, top_p, min_p, repetition_penalty, seed
        )
        if speculative is not None:
            return speculative_batch(
                self,
                rows, max_new_tokens, config, ignore_eos, stop, on_text,
                speculative, num_draft, self.draft_model(draft), adaptive,
            )  # fmt: skip
        return plain_batch(
            self,
            rows,
            max_new_tokens=max_new_tokens,
            config=config,
            ignore_eos=ignore_eos,
            stop=stop,
            on_text=on_text,
        )
