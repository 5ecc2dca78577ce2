"""The Python API: everything the CLI does, callable from code.

import specport
model = specport.load("out/llama")           # checks schema and hashes
result = model.generate("Once upon a time", max_new_tokens=32)
print(result.text, result.metrics["decode_tok_per_s"])
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from specport import artifact as art
from specport.errors import InputError

logger = logging.getLogger(__name__)


@dataclass
class GenerationResult:
    """One row's result; `Model.generate_batch` returns one per prompt."""

    tokens: list[int]  # new token ids
    text: str
    finish_reason: str
    metrics: dict[str, Any] = field(default_factory=dict)
    prompt_ids: list[int] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "tokens": self.tokens,
            "text": self.text,
            "finish_reason": self.finish_reason,
            "metrics": self.metrics,
        }


class Model:
    """A loaded artifact: manifest, onnxruntime session, tokenizer, and generation."""

    def __init__(
        self, path: Path, manifest: art.Manifest, session: Any, provider: str, tokenizer: Any | None
    ) -> None:
        self.path = path
        self.manifest = manifest
        self.session = session  # the plain onnxruntime.InferenceSession
        self.provider = provider
        self.tokenizer = tokenizer

    # ---- tokens <-> text -------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        from specport.runtime.tokenizer import encode_prompt

        return encode_prompt(self.tokenizer, text)

    def decode(self, ids: Sequence[int]) -> str:
        if self.tokenizer is None:
            return ""
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=True))

    # ---- generation ------------------------------------------------------------------
    def generate(
        self,
        prompt: str | None = None,
        *,
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
        num_draft: int = 4,
        draft: Model | str | os.PathLike[str] | None = None,
        adaptive: bool | None = None,
        tree_width: int = 1,
        sampling: Any = None,
    ) -> GenerationResult:
        """Generate for one prompt (text or ids). `on_text` receives text as it is produced.

        `speculative` ("ngram" | "draft" | "mtp") drafts `num_draft` tokens per step and verifies
        them in one run of this model; greedy output is token-for-token that of plain greedy.
        `adaptive` picks the draft length per step from recent acceptance (None: per-method default).
        `tree_width` > 1 (ngram only, artifact exported with `--tree-mask`) verifies that many
        candidate continuations at once as a token tree. `sampling` (a `SamplingConfig`, e.g.
        with OpenAI's presence / frequency penalties or a logit bias) replaces the separate
        sampling arguments.
        """
        if tree_width != 1 and speculative != "ngram":
            raise InputError(
                "--tree-width needs --speculative ngram (tree candidates come from n-gram matches)."
            )
        if (prompt is None) == (prompt_ids is None):
            raise InputError("give exactly one of prompt (text) or prompt_ids.")
        if speculative is not None:
            ids_one = list(prompt_ids) if prompt_ids is not None else self.encode(str(prompt))
            config = sampling or self._sampling(
                greedy, temperature, top_k, top_p, min_p, repetition_penalty, seed
            )
            if config.presence_penalty or config.frequency_penalty or config.logit_bias:
                raise InputError(
                    "presence / frequency penalties and logit_bias are not supported with "
                    "speculative decoding; use repetition_penalty, or decode without it."
                )
            return self._generate_speculative(
                ids_one,
                max_new_tokens=max_new_tokens,
                sampling=config,
                ignore_eos=ignore_eos,
                stop=stop,
                on_text=on_text,
                method=speculative,
                num_draft=num_draft,
                draft=draft,
                adaptive=adaptive,
                tree_width=tree_width,
            )
        prompts = [prompt] if prompt is not None else None
        ids = [list(prompt_ids)] if prompt_ids is not None else None
        stream = (lambda row, piece: on_text(piece)) if on_text else None
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
            on_text=stream,
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
        num_draft: int = 4,
        draft: Model | str | os.PathLike[str] | None = None,
        adaptive: bool | None = None,
        sampling: Any = None,
    ) -> list[GenerationResult]:
        """Generate for several prompts at once (left padding, per-row stopping).

        With `speculative` the rows are drafted and verified together (one batched run per step);
        greedy output equals plain greedy for every row.
        """
        from specport.runtime.generator import Generator
        from specport.runtime.sampler import Sampler
        from specport.runtime.streaming import TextStreams

        if prompt_ids is not None:
            rows = [[int(t) for t in p] for p in prompt_ids]
        elif prompts is not None:
            rows = [self.encode(p) for p in prompts]
        else:
            raise InputError("give prompts (text) or prompt_ids.")
        config = sampling or self._sampling(
            greedy, temperature, top_k, top_p, min_p, repetition_penalty, seed
        )
        if speculative is not None:
            return self._generate_speculative_batch(
                rows, max_new_tokens, config, ignore_eos, stop, on_text,
                speculative, num_draft, draft, adaptive,
            )  # fmt: skip
        sampler = Sampler(config, self.manifest.vocab_size)
        history = [np.asarray(r, dtype=np.int64) for r in rows]
        generated = [np.zeros(0, dtype=np.int64) for _ in rows]  # presence / frequency count these
        needs_history = config.needs_history

        def select(logits: np.ndarray, step: int) -> np.ndarray:
            if not needs_history:
                return sampler(logits)
            return sampler(logits, history, generated)

        if config.greedy and config.plain:
            from specport.runtime.generator import greedy_select

            select = greedy_select  # lets a fused graph pick the token in-graph (argmax there)

        streams = TextStreams(self.tokenizer, len(rows), list(stop), on_text)

        def on_step(new: np.ndarray, active: np.ndarray) -> np.ndarray | None:
            if needs_history:
                for r in np.flatnonzero(active):
                    history[r] = np.append(history[r], new[r])
                    generated[r] = np.append(generated[r], new[r])
            return streams.push(new, active)

        eos = [] if ignore_eos else self.manifest.eos_token_ids
        gen = Generator(self.session, self.manifest)
        per_step = needs_history or streams.needs_steps
        out = gen.generate(
            rows, max_new_tokens, select=select, eos_ids=eos, on_step=on_step if per_step else None
        )
        if not per_step:
            streams.push_all(out.tokens)
        texts = streams.finish()
        out.metrics["provider"] = self.provider
        results = []
        for r, toks in enumerate(out.tokens):
            text = texts[r] if self.tokenizer is not None else ""
            results.append(
                GenerationResult(toks, text, out.finish_reasons[r], dict(out.metrics), rows[r])
            )
        return results

    @staticmethod
    def _sampling(
        greedy: bool | None,
        temperature: float,
        top_k: int,
        top_p: float,
        min_p: float,
        repetition_penalty: float,
        seed: int | None,
    ) -> Any:
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

    def _generate_speculative(
        self,
        prompt_ids: list[int],
        *,
        max_new_tokens: int,
        sampling: Any,
        ignore_eos: bool,
        stop: Sequence[str],
        on_text: Callable[[str], None] | None,
        method: str,
        num_draft: int,
        draft: Model | str | os.PathLike[str] | None,
        adaptive: bool | None = None,
        tree_width: int = 1,
    ) -> GenerationResult:
        from specport.runtime.speculative.loop import generate_speculative
        from specport.runtime.streaming import TextStreams

        draft_model = self._draft_model(method, draft)
        streams = TextStreams(
            self.tokenizer, 1, list(stop), (lambda row, piece: on_text(piece)) if on_text else None
        )
        one = np.ones(1, dtype=bool)

        def on_token(tok: int) -> bool:
            hit = streams.push(np.array([tok], dtype=np.int64), one)
            return bool(hit is not None and hit[0])

        eos = [] if ignore_eos else self.manifest.eos_token_ids
        if tree_width != 1:
            from specport.runtime.speculative.tree import generate_tree

            tokens, reason, metrics = generate_tree(
                self, prompt_ids, max_new_tokens, num_draft, tree_width, sampling, eos, on_token
            )
        else:
            tokens, reason, metrics = generate_speculative(
                self,
                prompt_ids,
                max_new_tokens,
                method,
                num_draft,
                draft_model,
                sampling,
                eos,
                on_token,
                adaptive,
            )
        text = streams.finish()[0] if self.tokenizer is not None else ""
        metrics["provider"] = self.provider
        return GenerationResult(list(tokens), text, reason, metrics, prompt_ids)

    def _draft_model(
        self, method: str, draft: Model | str | os.PathLike[str] | None
    ) -> Model | None:
        draft_model = (
            load(draft, provider=self.provider) if isinstance(draft, (str, os.PathLike)) else draft
        )
        if method == "draft" and draft_model is None:
            raise InputError(
                "--speculative draft needs a draft artifact: pass --draft DIR (e.g. from `specport export MODEL --layers 2`)."
            )
        return draft_model

    def _generate_speculative_batch(
        self,
        rows: list[list[int]],
        max_new_tokens: int,
        sampling: Any,
        ignore_eos: bool,
        stop: Sequence[str],
        on_text: Callable[[int, str], None] | None,
        method: str,
        num_draft: int,
        draft: Model | str | os.PathLike[str] | None,
        adaptive: bool | None,
    ) -> list[GenerationResult]:
        from specport.runtime.speculative.batch import generate_speculative_batch
        from specport.runtime.streaming import TextStreams

        draft_model = self._draft_model(method, draft)
        streams = TextStreams(self.tokenizer, len(rows), list(stop), on_text)

        def on_token(row: int, tok: int) -> bool:
            new = np.zeros(len(rows), dtype=np.int64)
            active = np.zeros(len(rows), dtype=bool)
            new[row], active[row] = tok, True
            hit = streams.push(new, active)
            return bool(hit is not None and hit[row])

        eos = [] if ignore_eos else self.manifest.eos_token_ids
        tokens, reasons, metrics = generate_speculative_batch(
            self,
            rows,
            max_new_tokens,
            method,
            num_draft,
            draft_model,
            sampling,
            eos,
            on_token,
            adaptive,
        )
        texts = streams.finish()
        metrics["provider"] = self.provider
        return [
            GenerationResult(
                list(toks),
                texts[r] if self.tokenizer is not None else "",
                reasons[r],
                dict(metrics),
                rows[r],
            )
            for r, toks in enumerate(tokens)
        ]


def load(
    path: str | os.PathLike[str],
    *,
    provider: str = "auto",
    threads: int = 0,
    graph_optimization: str = "all",
    check_hashes: bool = True,
    allow_spinning: bool | None = None,
    prepacking: bool = True,
) -> Model:
    """Open an artifact: validate manifest and file hashes, start an onnxruntime session.

    `allow_spinning` (None = only when a core is idle) and `prepacking` are explained in
    `specport.runtime.session`."""
    from specport.runtime.session import SessionConfig, make_session
    from specport.runtime.tokenizer import load_tokenizer

    directory = Path(path)
    manifest = art.read_manifest(directory, check_hashes=check_hashes)
    session, used = make_session(
        directory / manifest.model_file,
        SessionConfig(
            provider=provider,
            intra_op_threads=threads,
            graph_optimization=graph_optimization,
            allow_spinning=allow_spinning,
            disable_prepacking=not prepacking,
            config_entries=artifact_session_entries(manifest),
        ),
    )
    tokenizer = load_tokenizer(directory, manifest.tokenizer)
    return Model(directory, manifest, session, used, tokenizer)


def artifact_session_entries(manifest: art.Manifest) -> dict[str, str]:
    """Session config entries the artifact's recipe requires (see the manifest's quant section)."""
    quant = manifest.quant or {}
    return {str(k): str(v) for k, v in (quant.get("ort_session_config") or {}).items()}


def export(
    model: str | os.PathLike[str], out: str | os.PathLike[str], **kwargs: Any
) -> art.Manifest:
    """Export a source model to an artifact directory; see `specport.exporter.export.export_model`."""
    from specport.exporter.export import export_model

    return export_model(model, out, **kwargs)


def quantize(
    src: str | os.PathLike[str], out: str | os.PathLike[str], **kwargs: Any
) -> art.Manifest:
    """Quantize an artifact into a new one; see `specport.passes.quant.apply.quantize_artifact`."""
    from specport.passes.quant.apply import quantize_artifact

    if not callable(kwargs.get("progress")):
        kwargs.pop("progress", None)  # a bool asks for the default display, which is stderr
    return quantize_artifact(src, out, **kwargs)
