import logging
from types import SimpleNamespace

from specport.runtime.speculative import exactness


def test_int8_activation_artifacts_warn_once(caplog, monkeypatch):
    monkeypatch.setattr(exactness, "_warned", set())
    w4a8 = SimpleNamespace(quant={"scheme": "w4a8"})
    with caplog.at_level(logging.WARNING):
        exactness.warn_if_not_token_exact(w4a8)
        exactness.warn_if_not_token_exact(w4a8)
        exactness.warn_if_not_token_exact(SimpleNamespace(quant={"scheme": "w4a16"}))
        exactness.warn_if_not_token_exact(SimpleNamespace(quant=None))
    warnings = [r for r in caplog.records if "int8" in r.getMessage()]
    assert len(warnings) == 1 and "w4a16" in warnings[0].getMessage()
    assert exactness.int8_activations(SimpleNamespace(quant={"scheme": "w8a8"}))


def test_weight_only_4bit_speculation_equals_plain_greedy(tiny_zoo, tmp_path):
    """w4a16 keeps float activations: speculative greedy is plain greedy token for token (the
    int8-activation schemes warn instead, see the module docstring)."""
    import specport
    from specport.runtime.sampler import SamplingConfig
    from specport.runtime.speculative.loop import generate_speculative

    out = tmp_path / "w4a16"
    specport.quantize(tiny_zoo.shared("llama"), out, scheme="w4a16")
    model = specport.load(out, threads=1)
    assert not exactness.int8_activations(model.manifest)
    for ids in ([5, 6, 7, 5, 6, 7, 5], [9, 30, 31, 9, 30], [100, 101, 102]):
        plain = model.generate(prompt_ids=ids, max_new_tokens=24, ignore_eos=True).tokens
        for method in ("ngram", "suffix"):
            toks, _, _ = generate_speculative(
                model, ids, 24, method, 4, None, SamplingConfig(), (), None, False
            )
            assert toks == plain, (method, ids)


def test_a_verdict_is_believed_only_where_its_kernels_are_row_invariant(caplog, monkeypatch):
    """A file quantized exact on one CPU records the int8 kernel kinds it relied on; where one
    of them computes a row differently in a run of several (4-bit blocks of 256 do on every CPU
    measured), speculation warns instead of promising plain greedy's tokens."""
    monkeypatch.setattr(exactness, "_warned", set())

    def artifact(kernels):
        verdict = {"exact": True, "reasons": [], "kernels": kernels}
        return SimpleNamespace(quant={"scheme": "w4a8", "token_exact_speculation": verdict})

    assert exactness.token_exact(artifact([[4, 16], [8, 64]]))
    elsewhere = artifact([[4, 16], [4, 256]])
    assert (
        exactness.not_exact_here(elsewhere)
        and "4-bit blocks of 256" in (exactness.not_exact_here(elsewhere)[0])
    )
    with caplog.at_level(logging.WARNING):
        exactness.warn_if_not_token_exact(elsewhere)
    assert any("blocks of 256" in r.getMessage() for r in caplog.records)
    # verdicts written before the kernels were recorded: the body's scheme and block
    legacy = {"exact": True, "reasons": []}
    old = SimpleNamespace(
        quant={"scheme": "w4a8", "group_size": 256, "token_exact_speculation": legacy}
    )
    assert not exactness.token_exact(old)
