"""The llama.cpp bench peer runs the artifact's checkpoint: its greedy tokens are the reference's."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest

from specport.bench import peers
from specport.core.errors import InputError

GGUF = Path("models") / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"
# the shared folder's README: greedy from "Once upon a time" (no BOS) with the fp32 weights
ONCE = [6403, 1980, 253, 655]


def _manifest(source: str, scheme: str | None = None) -> SimpleNamespace:
    return SimpleNamespace(source={"path": source}, quant={"scheme": scheme} if scheme else None)


def test_peer_names_are_checked_before_any_work() -> None:
    assert peers.check_peer_name("llama.cpp:Q4_K_M") == "llama.cpp:Q4_K_M"
    with pytest.raises(InputError, match="choose from"):
        peers.check_peer_name("llamacpp")
    with pytest.raises(InputError, match="choose from"):
        peers.check_peer_name("transformers:Q4_0")


def test_bit_width_picks_the_matching_gguf_type() -> None:
    from specport.bench.peer_llamacpp import matching_type

    assert matching_type(_manifest("m")) == "F32"  # type: ignore[arg-type]
    assert matching_type(_manifest("m", "w8a8")) == "Q8_0"  # type: ignore[arg-type]
    assert matching_type(_manifest("m", "w4a8")) == "Q4_0"  # type: ignore[arg-type]


def test_a_non_gguf_source_asks_for_peer_gguf(tmp_path: Path) -> None:
    from specport.bench.peer_llamacpp import source_gguf

    with pytest.raises(InputError, match="--peer-gguf"):
        source_gguf(_manifest(str(tmp_path)), None)  # type: ignore[arg-type]
    with pytest.raises(InputError, match="no such file"):
        source_gguf(_manifest(str(tmp_path)), str(tmp_path / "missing.gguf"))  # type: ignore[arg-type]


@pytest.mark.slow
@pytest.mark.shared
def test_llamacpp_peer_decodes_the_reference_tokens(shared_path: Callable[..., Path]) -> None:
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (bench extra)")
    gguf = shared_path(GGUF)
    from specport.bench.peer_llamacpp import LlamaCppPeer

    peer = LlamaCppPeer(_manifest(str(gguf)), SimpleNamespace(threads=2), "F32", None)  # type: ignore[arg-type]
    try:
        metrics = peer.run([ONCE], new_tokens=8)
        assert metrics["decode_steps"] == 7
        text = peer.llm.create_completion(ONCE, max_tokens=12, temperature=0.0)["choices"][0]
        assert text["text"].startswith(", the city of Nova Haven")
    finally:
        peer.close()
