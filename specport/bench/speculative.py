"""`specport bench --speculative`: plain greedy vs speculative methods on the same prompts.

Plain and speculative runs alternate within each round (so machine load hits both alike), the
per-prompt medians are summed, and every speculative output is checked against plain greedy:
a speed figure for a method whose tokens differ would be meaningless, so equality is reported
beside it.

"Plain" is plain decoding on the same base model: for an MTP artifact that is the graph
with the MTP branch left out (``runtime.session.artifact_graph``), because onnxruntime runs
every node whatever outputs are fetched and plain decoding on the MTP graph would pay for the
heads at every token (about 1.5x slower on stories260K), flattering the speculative figure.
N-gram and draft-model methods run on that base graph too, as they do everywhere else.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import specport
from specport.bench.prompt_sets import (
    BenchPrompt,
    PromptFileChoice,
    file_prompts,
    read_choice,
    set_prompt_ids,
)
from specport.bench.spec_peers import SpecPeer, check_spec_peer_name
from specport.bench.spec_tally import SpecTally, copied_share, format_category_table
from specport.core.errors import InputError
from specport.core.progress import Loop
from specport.core.prompt_files import PromptRecord
from specport.generation_args import TREE_METHODS, resolve_num_draft
from specport.loading import load
from specport.results import GenerationResult
from specport.runtime.speculative.loop import SpeculativeGenerator
from specport.runtime.speculative.metrics import step_overhead_ms
from specport.runtime.speculative.replay import ReplayProposer
from specport.runtime.speculative.tree import generate_tree

logger = logging.getLogger(__name__)

__all__ = [
    "SpecBenchConfig",
    "format_speculative_table",
    "run_speculative_bench",
]

# Runs a ceiling row may take to find a track its own verify runs keep (``follow_own_track``).
CEILING_RUNS = 3


@dataclass
class SpecBenchConfig:
    methods: list[str]
    num_draft: int = 4
    # auto's cap on a step's drafts: None = its own default (``AUTO_NUM_DRAFT``), as generate,
    # chat and serve run it; it sizes each step's drafts itself below the cap
    auto_num_draft: int | None = None
    draft: str | None = None
    prompts: list[str] = field(default_factory=list)
    prompt_ids: list[list[int]] = field(default_factory=list)  # used instead of text when given
    prompt_set: str = "story"
    max_new_tokens: int = 128
    runs: int = 3
    threads: int = 0
    adaptive: str = "default"  # "default" | "on" | "off" | "both" (each method twice)
    # ngram / mtp (those of `methods`; ngram when neither) as a token tree, per width
    tree_widths: list[int] = field(default_factory=list)
    peers: list[str] = field(default_factory=list)  # other tools, plain or `+ngram` (spec_peers)
    peer_gguf: str | None = None  # the GGUF llama.cpp runs when the source is not one
    allow_spinning: bool | None = None
    ceiling: bool = False  # add drafts that are always right (runtime/speculative/replay.py)
    suffix_corpus: str | None = None  # earlier answers --speculative suffix drafts from
    prompt_file: PromptFileChoice | None = None  # --prompts FILE (its categories: row groups)


ADAPTIVE_CHOICES = ("default", "on", "off", "both")


@contextmanager
def plain_reference(model: Any, threads: int = 0) -> Iterator[tuple[Any, str]]:
    """(model for plain decoding, what it is): the base graph of an MTP artifact, else ``model``.

    ``specport.load`` leaves the branch out unless asked for it (``mtp_branch``); a model that
    carries it is opened a second time without it, for as long as the context lasts.
    """
    if not model.has_mtp_branch:
        yield (
            model,
            "same artifact" if not model.manifest.mtp else "base graph (MTP branch left out)",
        )
        return

    config = model.session_config
    base = load(
        model.path,
        provider=model.provider,
        threads=threads,
        allow_spinning=config.resolved_spinning() if config is not None else None,
        check_hashes=False,
        mtp_branch=False,
    )
    logger.info("plain reference: the MTP graph without its branch")
    base.suffix_index = model.suffix_index
    yield base, "base graph (MTP branch left out)"


def _adaptive_variants(setting: str) -> list[tuple[str, bool | None]]:
    if setting not in ADAPTIVE_CHOICES:
        raise InputError(
            f"--adaptive must be one of {', '.join(ADAPTIVE_CHOICES)}, got {setting!r}."
        )
    variants: dict[str, list[tuple[str, bool | None]]] = {
        "default": [("", None)],
        "on": [("+adaptive", True)],
        "off": [("", False)],
        "both": [("", False), ("+adaptive", True)],
    }
    return variants[setting]


def run_speculative_bench(artifact: str, config: SpecBenchConfig) -> dict[str, Any]:
    """Decode speed and acceptance of each method vs plain greedy; JSON-able report."""

    for name in config.peers:
        check_spec_peer_name(name)  # before any model loads
    records, prompt_info = (
        read_choice(config.prompt_file) if config.prompt_file is not None else (None, None)
    )
    model = specport.load(
        artifact,
        threads=config.threads,
        allow_spinning=config.allow_spinning,
        mtp_branch="mtp" in config.methods,
        suffix_corpus=config.suffix_corpus,
    )
    # Rounds repeat the same prompts: a suffix index learning round 1's answers would draft
    # round 2's perfectly.
    model.suffix_index.learn = False
    peers = [SpecPeer(n, model.manifest, config, config.num_draft, None) for n in config.peers]
    try:
        with plain_reference(model, config.threads) as (plain_model, plain_what):
            report = _run(model, plain_model, artifact, config, peers, records, prompt_info)
    finally:
        for peer in peers:
            peer.close()
    report["plain"] = plain_what
    if peers:
        report["peers"] = {peer.name: peer.info() for peer in peers}
    return report


def _run(
    model: Any,
    plain_model: Any,
    artifact: str,
    config: SpecBenchConfig,
    peers: Sequence[Any] = (),
    records: Sequence[PromptRecord] | None = None,
    prompt_info: dict[str, Any] | None = None,
) -> dict[str, Any]:

    prompts, rendered = _prompts(model, plain_model, config, records)
    draft = model.draft_model(config.draft) if config.draft else None
    variants = _adaptive_variants(config.adaptive)
    engines: list[tuple[str, str | None, bool | None, int]] = [("plain", None, None, 0)]
    engines += [
        (m + suffix, m, adaptive, 0) for m in config.methods for suffix, adaptive in variants
    ]
    tree_methods = [m for m in config.methods if m in TREE_METHODS] or ["ngram"]
    # a tree engine (width > 0) runs the tree loop even at width 1 (MTP: the heads run on the
    # host beside a stripped graph, instead of the chain's in-graph branch)
    engines += [(f"{m}-tree{w}", m, None, w) for m in tree_methods for w in config.tree_widths]
    ceilings = {f"ceiling K={k}": k for k in ceiling_draft_lengths(config.num_draft)}
    engines += [(name, "ceiling", False, 0) for name in ceilings] if config.ceiling else []
    names = [name for name, *_ in engines] + [peer.name for peer in peers]
    tally = SpecTally(names)

    def run_engine(
        method: str | None, adaptive: bool | None, width: int, ids: list[int], new_tokens: int
    ) -> Any:
        if method is None:
            return plain_model.generate(prompt_ids=ids, max_new_tokens=new_tokens)
        if width:
            tree_model = plain_model if method == "ngram" else model
            return _run_tree(
                tree_model, ids, replace(config, max_new_tokens=new_tokens), method, width
            )
        # only chain MTP drafting needs the graph with the branch
        return (model if method == "mtp" else plain_model).generate(
            prompt_ids=ids,
            max_new_tokens=new_tokens,
            speculative=method,
            num_draft=config.auto_num_draft if method == "auto" else config.num_draft,
            draft=draft if method in ("draft", "auto") else None,  # auto: its model drafter
            adaptive=adaptive,
        )

    # Warm-up, untimed: one-time work (an MTP tree's derived verify graph, a draft session's
    # first run, onnxruntime's first-run allocations) must not land in the first prompt's time.
    for _name, method, adaptive, width in engines:
        if method != "ceiling":
            run_engine(method, adaptive, width, prompts[0].ids, 4)
    overheads: dict[str, list[float]] = {name: [] for name in names}  # the step's own ms
    loop = Loop(len(prompts) * config.runs, f"bench: {len(names)} engines, prompt x round")
    for prompt in prompts:
        ids = prompt.ids
        reference: list[int] | None = None
        per: dict[str, list[float]] = {name: [] for name in names}
        cpu: dict[str, list[float]] = {name: [] for name in names}  # CPU seconds per token
        stats: dict[str, dict[str, Any]] = {}
        counts: dict[str, int] = {}
        equal = dict.fromkeys(names, True)
        for _ in range(config.runs):
            for name, method, adaptive, width in engines:
                if method == "ceiling":
                    assert reference is not None  # plain runs first in every round
                    result = _run_ceiling(plain_model, ids, reference, config, ceilings[name])
                else:
                    result = run_engine(method, adaptive, width, ids, config.max_new_tokens)
                if reference is None:
                    reference = result.tokens
                equal[name] &= result.tokens == reference
                # Per-token decode time after the first token (plain) / all tokens (speculative).
                produced = max(len(result.tokens) - (1 if method is None else 0), 1)
                per[name].append(result.metrics["decode_wall_s"] / produced)
                cpu[name].append(decode_cpu_s(result.metrics) / produced)
                counts[name] = len(result.tokens)
                overhead = step_overhead_ms(result.metrics)
                if overhead is not None:
                    overheads[name].append(overhead)
                if method is not None:
                    stats[name] = result.metrics.get("speculative", {})
            assert reference is not None
            for peer in peers:  # as many tokens as plain greedy made, in the same round
                run = peer.run(ids, len(reference))
                if run.decode_cpu_s is not None:  # the peer's decoding process, all threads
                    cpu[peer.name].append(run.decode_cpu_s / max(len(run.tokens) - 1, 1))
                equal[peer.name] &= run.tokens == reference
                per[peer.name].append(run.decode_s / max(len(run.tokens) - 1, 1))
                counts[peer.name] = len(run.tokens)
                if run.rounds:
                    stats[peer.name] = {
                        "steps": run.rounds,
                        "accepted": len(run.tokens) - run.rounds,
                    }
            loop.update()
        copied = copied_share(ids, reference) if reference is not None else None
        tally.add(prompt.category, per, counts, equal, stats, copied, cpu)
    loop.close()
    report: dict[str, Any] = {
        "artifact": artifact,
        "prompts": len(prompts),
        "max_new_tokens": config.max_new_tokens,
        "num_draft": config.num_draft,
        "auto_num_draft": resolve_num_draft(model, "auto", config.auto_num_draft)
        if "auto" in config.methods
        else None,
        "runs": config.runs,
        "adaptive": config.adaptive,
        "rows": tally.rows(None, overheads),
    }
    if prompt_info is not None:
        report["prompt_file"] = prompt_info | {
            "rendered": rendered,
            "turns": len(prompts),
        }
    report["answer_ngrams_in_prompt"] = tally.copied_share()
    if tally.categories:
        report["categories"] = tally.category_reports()
    return report


def _prompts(
    model: Any, plain_model: Any, config: SpecBenchConfig, records: Sequence[PromptRecord] | None
) -> tuple[list[BenchPrompt], str]:
    """The prompts to decode, and how a prompt file's were rendered (prompt_sets.py)."""
    if records is not None:
        return file_prompts(model, plain_model, records, config.max_new_tokens)
    if config.prompt_ids:
        encoded = [list(p) for p in config.prompt_ids]
    elif config.prompts:
        encoded = [model.encode(text) for text in config.prompts]
    else:
        encoded = set_prompt_ids(model, config.prompt_set)
    return [BenchPrompt(ids) for ids in encoded], "ids"


def decode_cpu_s(metrics: dict[str, Any]) -> float:
    """A generation's decoding CPU time (this process, all threads: on a shared, oversubscribed
    machine it measures an engine's work far more steadily than wall time, which counts waiting
    for a core), over the span its ``decode_wall_s`` times: the prefill
    is left out of both clocks. Engines decode the same prompt one after another, and the
    generator reuses the KV of the prompt the previous call held, so a whole call's CPU time
    would charge the prefill to whichever engine ran first (on a 700-token prompt at W8A8, as
    much CPU as the 128 tokens' decoding)."""
    return float(metrics["decode_cpu_s"])


def ceiling_draft_lengths(num_draft: int) -> list[int]:
    """Draft lengths the ceiling rows run: 1, 2, 4, ... up to and including ``num_draft``."""
    lengths = [k for k in (1, 2, 4, 8, 16) if k < num_draft]
    return [*lengths, num_draft]


def _run_ceiling(
    model: Any, ids: list[int], reference: list[int], config: SpecBenchConfig, num_draft: int
) -> Any:
    """Greedy speculation whose K drafts are the run's own next tokens (all accepted).

    The drafts follow plain greedy's tokens. Where a verify run rounds differently from a
    one-token step (int8 activations: see the speculative guide), the run leaves that track
    at the first near-tie; past it the proposer keeps drafting (``keep_width``, rejected
    guesses), so the run's output is what wide verify runs choose, and ``follow_own_track``
    runs it again on that output, where every draft is right. Without it the row drafted
    nothing past the first near-tie and measured rounding, not the machine (SmolLM2 at
    w4a8: 1.35 tokens per step at K = 1)."""

    eos = model.manifest.eos_token_ids  # as Model.generate stops

    def run(track: list[int]) -> GenerationResult:
        proposer = ReplayProposer(ids, track, keep_width=True)
        gen = SpeculativeGenerator(
            model.session, model.manifest, proposer, num_draft, adaptive=False
        )
        out = gen.generate(ids, config.max_new_tokens, eos_ids=eos)
        return GenerationResult(list(out.tokens), "", out.finish_reason, out.metrics, ids)

    return follow_own_track(run, reference, CEILING_RUNS)


def follow_own_track(
    run: Callable[[list[int]], GenerationResult], track: list[int], runs: int
) -> GenerationResult:
    """``run(track)``, rerun on its own output while that differs from the track it was given
    (at most ``runs`` runs; the last is the one timed). On SmolLM2 at w4a8 the first run
    left plain greedy's track 8-52 tokens in and the second kept its own to the end: which
    near-ties flip does not depend on the verify width."""
    result = run(track)
    for _ in range(runs - 1):
        if result.tokens == track:
            break
        track = list(result.tokens)
        result = run(track)
    return result


def _run_tree(model: Any, ids: list[int], config: SpecBenchConfig, method: str, width: int) -> Any:
    """One greedy token-tree generation (any width, 1 included) as a GenerationResult."""

    eos = model.manifest.eos_token_ids  # as Model.generate stops
    tokens, reason, metrics = generate_tree(
        model, ids, config.max_new_tokens, config.num_draft, width, eos_ids=eos, method=method
    )
    return GenerationResult(list(tokens), "", reason, metrics, ids)


def format_speculative_table(report: dict[str, Any]) -> str:
    w = max(24, *(len(r["engine"]) + 2 for r in report["rows"]))  # peer names run long
    lines = [
        f"{report['prompts']} prompts, {report['max_new_tokens']} new tokens, K={report['num_draft']}"
        + (f" (auto: up to {report['auto_num_draft']})" if report.get("auto_num_draft") else "")
        + ", "
        f"median of {report['runs']} runs; plain = {report.get('plain', 'same artifact')}"
        + ("; equal = tokens equal specport's plain greedy" if report.get("peers") else ""),
        f"{'engine':<{w}}{'decode tok/s':>14}{'vs plain':>10}{'accepted/step':>15}{'equal':>8}"
        f"{'step ms':>9}{'cpu vs plain':>14}",
    ]
    for r in report["rows"]:
        mal = r.get("mean_accepted_length")
        over = r.get("step_overhead_ms")
        cpu = r.get("cpu_speedup_vs_plain")
        lines.append(
            f"{r['engine']:<{w}}{r['decode_tok_per_s'] or 0:>14.1f}{r['speedup_vs_plain'] or 0:>9.2f}x"
            f"{'-' if mal is None else f'{mal:.2f}':>15}{'yes' if r['tokens_equal_plain'] else 'NO':>8}"
            f"{'-' if over is None else f'{over:.2f}':>9}"
            f"{'-' if cpu is None else f'{cpu:.2f}x':>14}"
        )
    for r in report["rows"]:
        if r.get("choices"):
            total = sum(r["choices"].values())
            shares = ", ".join(f"{what} {100 * n / total:.0f}%" for what, n in r["choices"].items())
            lines.append(f"{r['engine']} chose per step: {shares}")
    source = report.get("prompt_file")
    if source:
        lines.append(
            f"prompts: {source['path']} ({source['format']}, {source['selected']} of "
            f"{source['records']} records, split {source['split']}, {source['turns']} turns, "
            f"{source['rendered']})"
        )
    categories = format_category_table(report)
    return "\n".join(lines) + ("\n\n" + categories if categories else "")
