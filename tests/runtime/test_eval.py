"""runtime/eval.py against transformers: perplexity on the same tokens, and compare()."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from specport.core.errors import InputError
from specport.runtime.eval import compare, compare_many, perplexity, read_documents
from tests.passes.quant._tiny import char_tokenizer, with_tokenizer, write_corpus


def _hf_ppl(model, seqs: list[list[int]]) -> float:
    total, count = 0.0, 0
    with torch.no_grad():
        for ids in seqs:
            t = torch.tensor([ids])
            logits = model(t).logits[0].double()
            lp = torch.log_softmax(logits, -1)
            total -= float(lp[torch.arange(len(ids) - 1), t[0, 1:]].sum())
            count += len(ids) - 1
    return math.exp(total / count)


@pytest.fixture(scope="module")
def eval_art(tiny_llama_artifact: Path, tmp_path_factory) -> Path:
    return with_tokenizer(tiny_llama_artifact, tmp_path_factory.mktemp("eval") / "art")


def test_perplexity_matches_torch_on_tiny(eval_art, tiny_zoo, tmp_path):
    text = write_corpus(tmp_path / "t.txt", docs=6)
    r = perplexity(eval_art, text)
    tok = char_tokenizer()
    seqs = [
        [1, *tok.encode(d, add_special_tokens=False).ids][:128] for d in read_documents(text)
    ]  # context 128
    ref = _hf_ppl(tiny_zoo.reference("llama"), seqs)
    assert r["docs"] == 6 and r["tokens"] == sum(len(s) - 1 for s in seqs)
    assert r["ppl"] == pytest.approx(ref, rel=1e-4)


def test_compare_self_and_max_docs(eval_art, tmp_path):
    text = write_corpus(tmp_path / "t.txt", docs=5)
    c = compare(eval_art, eval_art, text, max_docs=3)
    assert c["top1_agreement"] == 1.0 and abs(c["kl"]) < 1e-9 and c["docs"] == 3
    assert c["ppl_a"] == pytest.approx(c["ppl_b"])
    last = perplexity(eval_art, text, max_docs=2, last=True)
    assert last["docs"] == 2


@pytest.mark.parametrize("memory", [None, 1], ids=["one-pass", "a-pass-each"])
def test_compare_many_equals_each_compare(eval_art, tmp_path, memory):
    """Several artifacts against one reference, scored in one pass over the reference (or a
    pass each when memory allows only one at a time): the numbers of a compare() of each."""
    from specport.passes.quant.apply import quantize_artifact

    text = write_corpus(tmp_path / "t.txt", docs=4)
    w4 = tmp_path / "w4"
    quantize_artifact(eval_art, w4, scheme="w4a16", algo="rtn", group_size=16)
    many = compare_many(eval_art, [w4, eval_art], text, memory=memory)
    for other, got in zip([w4, eval_art], many):
        assert got == pytest.approx(compare(eval_art, other, text), rel=1e-12)
        assert got["ppl_b"] == pytest.approx(perplexity(other, text)["ppl"], rel=1e-9)
    assert many[0]["ppl_a"] == pytest.approx(perplexity(eval_art, text)["ppl"], rel=1e-9)
    assert many[1]["top1_agreement"] == 1.0 and many[0]["kl"] > 1e-6


def test_compare_many_checks_every_path_first(eval_art, tmp_path):
    text = write_corpus(tmp_path / "t.txt", docs=2)
    with pytest.raises(InputError, match="missing"):
        compare_many(eval_art, [eval_art, tmp_path / "missing"], text, memory=1)


def test_bad_inputs(eval_art, tmp_path):
    with pytest.raises(InputError, match="not found"):
        perplexity(eval_art, tmp_path / "missing.txt")
    (tmp_path / "empty.txt").write_text("\n\n\n")
    with pytest.raises(InputError, match="no documents"):
        perplexity(eval_art, tmp_path / "empty.txt")


@pytest.mark.slow
@pytest.mark.shared
def test_stories260k_matches_transformers(shared_path, tmp_path):
    """Real model: our ONNX perplexity vs transformers' own, same protocol, within 0.5%."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    from tests.export_cache import cached_export

    src = shared_path("models", "stories260K")
    text = shared_path("text", "tinystories_valid_dev.txt")
    art = tmp_path / "s260"
    cached_export(src, art, progress=False)
    r = perplexity(art, text, max_docs=40)

    hf_tok = AutoTokenizer.from_pretrained(str(src))
    docs = read_documents(text, 40)
    seqs = [hf_tok(d).input_ids[:512] for d in docs]  # BOS added by the HF tokenizer
    assert all(s[0] == 1 for s in seqs)
    model = LlamaForCausalLM.from_pretrained(str(src)).eval()
    ref = _hf_ppl(model, seqs)
    assert r["tokens"] == sum(len(s) - 1 for s in seqs)  # same tokenization
    assert abs(r["ppl"] / ref - 1) < 0.005
    assert 3.0 < r["ppl"] < 10.0
    np.testing.assert_allclose(r["ppl"], ref, rtol=1e-4)


@pytest.mark.slow
def test_perplexity_on_a_shared_layout_artifact(tiny_zoo, tmp_path):
    """The in-place layout scores every position through logits_index: same numbers as torch."""
    from tests.export_cache import cached_export

    art = cached_export(
        tiny_zoo.source("llama"), tmp_path / "s", kv_layout="shared", max_length=128, progress=False
    )
    assert art.kv.layout == "shared"
    shared = with_tokenizer(tmp_path / "s", tmp_path / "art")
    text = write_corpus(tmp_path / "t.txt", docs=4)
    tok = char_tokenizer()
    seqs = [[1, *tok.encode(d, add_special_tokens=False).ids][:128] for d in read_documents(text)]
    ref = _hf_ppl(tiny_zoo.reference("llama"), seqs)
    assert perplexity(shared, text)["ppl"] == pytest.approx(ref, rel=1e-4)
    assert perplexity(shared, text, chunk=5)["ppl"] == pytest.approx(ref, rel=1e-4)
