"""Servers shared by the serve tests: the tiny Llama (concat layout: serial engine, token ids),
the same model with the shared KV layout (continuous batching), and stories260K (text)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import specport
from tests.runtime.serve.helpers import CHAT_TEMPLATE, serve


def _make_engine(model: Any) -> Any:
    from specport.runtime.engine import make_engine

    return make_engine(model, max_batch=4, kind="auto")


@pytest.fixture(scope="module")
def tiny_model(tiny_llama_artifact: Path) -> Any:
    return specport.load(tiny_llama_artifact, threads=1)


@pytest.fixture(scope="module")
def tiny_server(tiny_model: Any):
    engine = _make_engine(tiny_model)
    server = serve(tiny_model, engine, model_name="tiny", max_body_bytes=64 * 1024)
    yield server
    server.stop()
    engine.close()


@pytest.fixture(scope="module")
def batching(tiny_zoo: Any, tmp_path_factory: pytest.TempPathFactory):
    """The tiny Llama exported with the shared KV layout: make_engine picks continuous batching."""
    from tests.export_cache import cached_export

    art = tmp_path_factory.mktemp("serve_shared") / "art"
    cached_export(tiny_zoo.source("llama"), art, kv_layout="shared", progress=False)
    model = specport.load(art, threads=1)
    engine = _make_engine(model)
    server = serve(model, engine)
    yield model, server
    server.stop()
    engine.close()


@pytest.fixture(scope="module")
def stories(shared_path: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory):
    """stories260K served with a (test-only) chat template added to its artifact."""
    from tests.export_cache import cached_export

    src = shared_path("models", "stories260K")
    art = tmp_path_factory.mktemp("serve_s260") / "s260"
    cached_export(src, art, fuse=False, skip_verify=True, progress=False)
    (art / "chat_template.jinja").write_text(CHAT_TEMPLATE)  # not hashed: not in the manifest
    model = specport.load(art, threads=1)
    engine = _make_engine(model)
    server = serve(model, engine, model_name="s260")
    yield model, server
    server.stop()
    engine.close()


def byte_tokenizer() -> Any:
    """A real byte-level `tokenizers.Tokenizer` whose 256 ids are the 256 bytes (GPT-2's byte
    alphabet), to give the tokenizer-less tiny model text in and out."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars, n = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + n)
            n += 1
    vocab = {chars[b]: b for b in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(chars[1], special=True), AddedToken(chars[2], special=True)])
    assert tok.token_to_id(chars[2]) == 2  # BOS / EOS keep their ids, decode skips them
    return tok


@pytest.fixture(scope="module")
def bytes_batching(batching):
    """The shared-layout tiny Llama with a byte tokenizer: continuous batching with text."""
    model, _ = batching
    model = specport.load(model.path, threads=1)
    model.tokenizer = byte_tokenizer()
    engine = _make_engine(model)
    server = serve(model, engine, model_name="bytes", chat_template=CHAT_TEMPLATE)
    yield model, server
    server.stop()
    engine.close()
