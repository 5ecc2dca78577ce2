"""Peers in `specport bench --speculative`: the other tools decoding the same prompts, plainly
or with their own speculative decoding, so the fastest configurations meet side by side.

A peer name is `onnxruntime-genai` or `llama.cpp` (`llama.cpp:TYPE` picks the GGUF type), with
`+ngram` for the tool's own prompt-lookup speculation: onnxruntime-genai's n-gram strategy
(`GeneratorParams.set_speculative_options`) and llama-cpp-python's `LlamaPromptLookupDecoding`.
Both verify greedily, so their tokens are their own plain greedy tokens. Each peer makes exactly
as many tokens as specport's plain greedy made for the prompt (EOS ignored), so the per-token
rates cover the same text length; whether its tokens equal specport's is reported, not required
(another tool's kernels may round differently).

OpenVINO GenAI (`openvino-genai[:f32|:default][+lookup|+draft]`, peer_openvino.py) runs in its
own venv through a worker process; `+lookup` is its prompt-lookup decoding and `+draft` its
draft-model speculation with the source model of `--draft ARTIFACT`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from specport.artifact import manifest as art
from specport.bench.peer_openvino import OpenVinoPeer, is_openvino, parse_name
from specport.bench.peers import make_peer
from specport.core.errors import InputError

SPECULATION_SUFFIX = "+ngram"
# every suffix that names a peer's own speculative decoding (OpenVINO GenAI's are its own names)
SPEC_SUFFIXES = (SPECULATION_SUFFIX, "+lookup", "+draft")
SPEC_PEERS = ("onnxruntime-genai", "llama.cpp")
NGRAM_SIZE = 2  # the n-gram both peers match on (llama-cpp-python's default lookup size)


@dataclass
class PeerRun:
    tokens: list[int]
    decode_s: float  # from the first new token to the last
    rounds: int | None = None  # model runs after the first token, where the peer reports them
    decode_cpu_s: float | None = None  # CPU seconds over decode_s, where the peer reports them


def check_spec_peer_name(name: str) -> tuple[str, bool]:
    """(peer name for `peers.make_peer`, uses its own n-gram speculation)."""
    if is_openvino(name):
        return name, parse_name(name).mode != "plain"
    base, speculate = (
        (name[: -len(SPECULATION_SUFFIX)], True)
        if name.endswith(SPECULATION_SUFFIX)
        else (name, False)
    )
    if base.partition(":")[0] not in SPEC_PEERS or (
        ":" in base and not base.startswith("llama.cpp")
    ):
        raise InputError(
            f"peer {name!r} cannot run beside --speculative; choose from "
            f"{', '.join(SPEC_PEERS)}, each optionally with {SPECULATION_SUFFIX} "
            "(its own n-gram speculation), e.g. llama.cpp+ngram, or "
            "openvino-genai[:default][+lookup|+draft]."
        )
    return base, speculate


class SpecPeer:
    """One peer engine of the speculative bench: `run(prompt ids, tokens to make)`."""

    def __init__(
        self, name: str, manifest: art.Manifest, config: Any, num_draft: int, progress: bool | None
    ) -> None:

        base, self.speculate = check_spec_peer_name(name)
        self.name = name
        self.num_draft = num_draft
        self.kind = base.partition(":")[0]
        if is_openvino(name):  # its speculation is chosen when its pipeline is built
            self.kind = "openvino-genai"
            self.peer: Any = OpenVinoPeer(manifest, config, name, num_draft, progress)
            return
        self.peer = make_peer(base, manifest, config, progress)
        if self.kind == "llama.cpp" and self.speculate:
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

            self.peer.draft = LlamaPromptLookupDecoding(
                max_ngram_size=NGRAM_SIZE, num_pred_tokens=num_draft
            )

    def info(self) -> dict[str, Any]:
        info: dict[str, Any] = dict(self.peer.info())
        if self.speculate and self.kind != "openvino-genai":  # that one says its own
            info["speculation"] = {"ngram_size": NGRAM_SIZE, "max_draft_tokens": self.num_draft}
        return info

    def run(self, ids: Sequence[int], new_tokens: int) -> PeerRun:
        if self.kind == "llama.cpp":
            return self._run_llamacpp(ids, new_tokens)
        if self.kind == "openvino-genai":
            tokens, decode_s, runs, cpu_s = self.peer.generate(ids, new_tokens)
            return PeerRun(tokens, decode_s, runs if self.speculate else None, cpu_s)
        return self._run_genai(ids, new_tokens)

    def _run_genai(self, ids: Sequence[int], new_tokens: int) -> PeerRun:
        og = self.peer.og
        prompt = np.asarray([list(ids)], dtype=np.int32)
        params = og.GeneratorParams(self.peer.model)
        total = prompt.shape[1] + new_tokens
        params.set_search_options(max_length=total, min_length=total, do_sample=False)
        if self.speculate:
            params.set_speculative_options(ngram_size=NGRAM_SIZE, max_draft_tokens=self.num_draft)
        gen = og.Generator(self.peer.model, params)
        gen.append_tokens(prompt)
        gen.generate_next_token()  # the first token: sampled from the prefill's logits
        t1, c1 = time.perf_counter(), time.process_time()
        while not gen.is_done():
            gen.generate_next_token()
        t2, c2 = time.perf_counter(), time.process_time()
        tokens = [int(t) for t in gen.get_sequence(0)[prompt.shape[1] :]]
        rounds = None
        if self.speculate:
            stats = gen.get_speculative_stats()  # model runs that made tokens, verify included
            rounds = int(stats.get("target_forward_passes", 0)) or None
        del gen
        return PeerRun(tokens[:new_tokens], t2 - t1, rounds, c2 - c1)

    def _run_llamacpp(self, ids: Sequence[int], new_tokens: int) -> PeerRun:
        llm = self.peer.ensure(len(ids) + new_tokens + self.num_draft + 8)
        llm.reset()
        tokens: list[int] = []
        t1, c1 = time.perf_counter(), time.process_time()
        for token in llm.generate([int(t) for t in ids], temp=0.0, top_k=1, reset=True):
            tokens.append(int(token))
            if len(tokens) == 1:
                t1, c1 = time.perf_counter(), time.process_time()
            if len(tokens) >= new_tokens:
                break
        return PeerRun(tokens, time.perf_counter() - t1, None, time.process_time() - c1)

    def close(self) -> None:
        self.peer.close()
