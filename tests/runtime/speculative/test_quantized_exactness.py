"""Speculation on int8-activation artifacts keeps plain greedy's tokens, bit for bit below them.

`specport quantize --scheme w4a8|w8a8 --exact-speculation` makes the graph row-invariant
(passes/quant/row_invariance.py, pad_attention_rows.py): a verify run over 1 + K tokens computes every
position's logits and KV exactly as K + 1 one-token steps do. Checked two ways on the tiny
Llama, for scheme x layout: the logits and KV of a verify run equal the steps' bit for bit
(what makes the tokens equal, and what float-rounding luck cannot fake), and greedy speculative
tokens equal plain greedy's for n-gram and draft-model speculation through `Model.generate`
and the batched generator (`generate_batch`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from benchmarks.row_invariance import compare

SCHEMES = ("w4a8", "w8a8")
LAYOUTS = ("concat", "shared")
NEW = 24


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        base = [1, *rng.integers(3, 250, size=int(rng.integers(2, 8))).tolist()]
        out.append(base * (1 + i % 3))  # some prompts repeat themselves: n-gram hits
    return out


@pytest.fixture(scope="module")
def arts(tmp_path_factory) -> dict[str, Any]:
    """(layout, scheme) -> quantized artifact path; "draft" -> a 1-layer float draft model."""
    import specport
    from tests.export_cache import cached_export
    from tests.fixtures import build_tiny_model
    from tests.passes.quant._tiny import with_tokenizer, write_corpus

    tmp: Path = tmp_path_factory.mktemp("qexact")
    src = build_tiny_model("llama", tmp / "src")
    calib = write_corpus(tmp / "calib.txt", docs=24, seed=0)
    kw: dict[str, Any] = dict(skip_verify=True, progress=False)
    out: dict[str, Any] = {}
    for layout in LAYOUTS:
        cached_export(src, tmp / layout, kv_layout=layout, **kw)
        base = with_tokenizer(tmp / layout, tmp / f"{layout}-tok")
        for scheme in SCHEMES:
            dst = tmp / f"{layout}-{scheme}"
            specport.quantize(
                base, dst, scheme=scheme, calib_files=[calib], calib_docs=24, exact_speculation=True
            )
            out[(layout, scheme)] = dst
        # without the option: the verdict says why speculation may leave plain greedy's tokens
        plain = specport.quantize(base, tmp / f"{layout}-fast", scheme="w4a8", algo="rtn")
        out[(layout, "fast")] = plain.quant["token_exact_speculation"]
    cached_export(src, tmp / "draft", kv_layout="shared", layers=1, **kw)
    out["draft"] = specport.load(tmp / "draft", threads=1)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_verify_run_computes_as_one_token_steps(arts, layout, scheme):
    from specport.artifact.manifest import read_manifest
    from specport.passes.quant.row_invariance import kernels_row_invariant

    path = arts[(layout, scheme)]
    verdict = read_manifest(path).quant["token_exact_speculation"]
    assert verdict["exact"] and verdict["reasons"] == [], verdict
    assert kernels_row_invariant(verdict["kernels"]) == []  # and where it runs: here
    fast = arts[(layout, "fast")]
    assert not fast["exact"]
    assert any("GroupQueryAttention without a padded" in r for r in fast["reasons"]), fast
    for prompt in ([1, 5, 6, 7, 8, 9, 10, 11], [1, 200, 3]):
        report = compare(path, prompt, tokens=5, threads=1)
        assert report["origins"] == [] and report["differs"] == {}, report["origins"][:3]
        assert report["kv_differs"] == [] and report["logits_max_abs"] == 0.0


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["generate", "generate_batch"])
@pytest.mark.parametrize("method", ["ngram", "draft"])
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_speculative_tokens_equal_plain(arts, layout, scheme, method, engine, caplog):
    import specport

    model = specport.load(arts[(layout, scheme)], threads=1)
    prompts = _prompts(5, seed=1)
    plain = [
        model.generate(prompt_ids=p, max_new_tokens=NEW, ignore_eos=True).tokens for p in prompts
    ]
    kw: dict[str, Any] = dict(max_new_tokens=NEW, ignore_eos=True, speculative=method)
    if method == "draft":
        kw["draft"] = arts["draft"]
    for k in (1, 3):
        if engine == "generate":
            got = [model.generate(prompt_ids=p, num_draft=k, **kw).tokens for p in prompts]
        else:
            got = [o.tokens for o in model.generate_batch(prompt_ids=prompts, num_draft=k, **kw)]
        assert got == plain, (layout, scheme, method, engine, k)
    assert "int8" not in caplog.text  # token-exact: no warning that it might not be


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_perplexity_is_the_same_through_one_and_five_token_runs(arts, layout, tmp_path, capsys):
    """`eval ppl --chunk N` scores text through runs of N tokens over the cache: plain
    decoding's run width (1) and a verify run's (5) give the same figure to the last bit, also
    where a document fills its KV buffer (no slot for the dummy row: the run goes unpadded)."""
    import json

    from specport.cli import main
    from tests.passes.quant._tiny import write_corpus

    text = write_corpus(tmp_path / "eval.txt", docs=4, seed=3)
    got = []
    for chunk in ("1", "5"):
        args = ["eval", "ppl", str(arts[(layout, "w8a8")]), "--text", str(text), "--chunk", chunk]
        assert main([*args, "--json"]) == 0
        got.append(json.loads(capsys.readouterr().out)["ppl"])
    assert got[0] == got[1]
