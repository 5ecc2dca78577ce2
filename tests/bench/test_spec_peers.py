"""Other tools beside `bench --speculative`: their own n-gram speculation decodes their own plain
greedy tokens, and the report puts them in the same table as specport's methods."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest

from specport.bench.spec_peers import check_spec_peer_name
from specport.core.errors import InputError
from tests.fixtures import TINY, make_llama

GGUF = Path("models") / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"
# repeated text, where prompt lookup proposes drafts that greedy decoding keeps
COPY_IDS = [1, 30, 31, 32, 33, 34, 30, 31, 32, 33, 34, 30, 31, 32, 33, 34, 30, 31]


def test_peer_names_are_checked_before_any_model_loads() -> None:
    assert check_spec_peer_name("llama.cpp+ngram") == ("llama.cpp", True)
    assert check_spec_peer_name("llama.cpp:Q4_K_M+ngram") == ("llama.cpp:Q4_K_M", True)
    assert check_spec_peer_name("onnxruntime-genai") == ("onnxruntime-genai", False)
    for bad in ("transformers+ngram", "onnxruntime-genai:int4", "vllm"):
        with pytest.raises(InputError, match=r"\+ngram"):
            check_spec_peer_name(bad)


@pytest.mark.slow
def test_speculative_bench_runs_genai_with_and_without_its_ngram(tmp_path, capsys, monkeypatch):
    pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai is not installed")
    from specport.cli import main
    from tests.export_cache import cached_export

    monkeypatch.setenv("SPECPORT_CACHE", str(tmp_path / "cache"))
    hf = make_llama(tmp_path / "hf", context_length=128, **TINY)
    cached_export(hf, tmp_path / "art", kv_layout="shared", progress=False)
    ids = ",".join(str(t) for t in COPY_IDS)
    args = ["bench", str(tmp_path / "art"), "--speculative", "ngram", "--prompt-ids", ids]
    args += ["--new-tokens", "12", "--runs", "1", "--threads", "1", "--json"]
    args += ["--peer", "onnxruntime-genai", "--peer", "onnxruntime-genai+ngram"]
    assert main(args) == 0
    report = json.loads(capsys.readouterr().out)
    rows = {r["engine"]: r for r in report["rows"]}
    assert set(rows) == {"plain", "ngram", "onnxruntime-genai", "onnxruntime-genai+ngram"}
    assert rows["ngram"]["tokens_equal_plain"]
    assert all(r["decode_tok_per_s"] > 0 for r in rows.values())
    assert report["peers"]["onnxruntime-genai+ngram"]["speculation"]["max_draft_tokens"] == 4
    # genai's own n-gram speculation verifies greedily: its tokens are genai's plain tokens
    from specport.artifact import manifest as art
    from specport.bench.spec_peers import SpecPeer

    manifest = art.read_manifest(tmp_path / "art")
    config = SimpleNamespace(threads=1, allow_spinning=False)
    runs = []
    for name in ("onnxruntime-genai", "onnxruntime-genai+ngram"):
        peer = SpecPeer(name, manifest, config, num_draft=4, progress=False)
        try:
            runs.append(peer.run(COPY_IDS, 12))
        finally:
            peer.close()
    assert len(runs[0].tokens) == 12
    assert runs[1].tokens == runs[0].tokens


@pytest.mark.slow
@pytest.mark.shared
def test_llamacpp_prompt_lookup_keeps_its_greedy_tokens(shared_path: Callable[..., Path]) -> None:
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (bench extra)")
    gguf = shared_path(GGUF)
    from specport.bench.spec_peers import SpecPeer

    manifest = SimpleNamespace(source={"path": str(gguf)}, quant=None)
    config = SimpleNamespace(threads=2, peer_gguf=None)
    prompt = [6403, 1980, 253, 655, 28, 260, 3444, 282, 6403, 1980, 253, 655, 28]
    runs = []
    for name in ("llama.cpp", "llama.cpp+ngram"):
        peer = SpecPeer(name, manifest, config, num_draft=4, progress=False)  # type: ignore[arg-type]
        try:
            runs.append(peer.run(prompt, 24))
        finally:
            peer.close()
    assert len(runs[0].tokens) == 24
    assert runs[1].tokens == runs[0].tokens
