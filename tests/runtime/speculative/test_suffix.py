import numpy as np
import pytest

from specport.core.errors import InputError
from specport.runtime.speculative.suffix import SEPARATOR, SuffixIndex, SuffixProposer


def test_index_drafts_the_most_frequent_earlier_continuation():
    index = SuffixIndex(max_n=4)
    index.extend([[1, 2, 3, 4, 5], [9, 2, 3, 4, 6], [7, 2, 3, 4, 5, 8]])
    n, ends = index.longest_match([0, 2, 3, 4], min_n=1)
    assert n == 3 and len(ends) == 3
    assert index.continuation(ends, 3, min_share=0.25) == [5, 8]  # 5 follows two of three
    assert index.continuation(ends, 3, min_share=0.5) == [5]  # 8 follows only one


def test_no_match_across_sequences_or_below_min_n():
    index = SuffixIndex(max_n=3)
    index.extend([[1, 2], [3, 4]])
    assert index.longest_match([2, 3], min_n=2)[0] == 0  # "2 3" spans the separator
    assert index.longest_match([5, 6], min_n=1)[0] == 0
    assert index.continuation(index.longest_match([2], 1)[1], 2, 0.1) == []  # 2 ends its answer


def test_corpus_keeps_the_newest_whole_sequences():
    index = SuffixIndex(max_n=2, max_tokens=8)
    index.extend([[1, 2, 3], [4, 5, 6], [7, 8, 9]])
    assert index.tokens().tolist() == [4, 5, 6, SEPARATOR, 7, 8, 9, SEPARATOR]
    assert index.longest_match([1, 2], 1)[0] == 0 and index.sequences == 2


def test_proposer_prefers_the_requests_own_text_on_ties():
    index = SuffixIndex(max_n=4)
    index.add([5, 6, 1, 1])
    proposer = SuffixProposer(index, min_n=2)
    assert proposer.propose([[5, 6, 7, 5, 6]], 2).row(0) == [7, 5]  # own text, same n
    assert proposer.propose([[0, 5, 6]], 2).row(0) == [1, 1]  # only the corpus has it
    assert proposer.propose([[8, 9]], 2).row(0) == []


def test_bad_corpus_is_refused():
    with pytest.raises(InputError):
        SuffixIndex().add([1, -5])
    with pytest.raises(InputError):
        SuffixProposer(SuffixIndex(max_n=2), min_n=3)


def test_large_corpus_lookup_is_exact():
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, 50, size=40).tolist() for _ in range(200)]
    index = SuffixIndex(max_n=5)
    index.extend(seqs)
    probe = seqs[17][10:15]
    n, ends = index.longest_match(probe, 1)
    assert n == 5
    flat = index.tokens()
    assert all(flat[e - 4 : e + 1].tolist() == probe for e in ends)


@pytest.mark.parametrize("layout", ["shared", "concat"])
def test_suffix_greedy_equals_plain_with_a_corpus(tiny_zoo, layout):
    """Drafts from a corpus holding the right answers and from one holding wrong ones: either
    way the output is plain greedy's, and the right corpus gets its drafts accepted."""
    import specport
    from specport.runtime.sampler import SamplingConfig
    from specport.runtime.speculative.loop import generate_speculative

    path = tiny_zoo.shared("llama") if layout == "shared" else tiny_zoo.artifact("llama")
    model = specport.load(path, threads=1)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 200, size=6).tolist() for _ in range(4)]
    plain = [
        model.generate(prompt_ids=p, max_new_tokens=20, ignore_eos=True).tokens for p in prompts
    ]
    wrong = SuffixIndex()
    wrong.extend([[t + 1 for t in a] + a[:5] for a in plain])
    right = SuffixIndex()
    right.extend(plain)
    for index, name in ((wrong, "wrong"), (right, "right")):
        model.suffix_index = index
        accepted = 0
        for p, want in zip(prompts, plain):
            toks, reason, metrics = generate_speculative(
                model, p, 20, "suffix", 4, None, SamplingConfig(), (), None, None
            )
            assert toks == want, (name, layout)
            assert metrics["kv_layout"] == layout
            accepted += metrics["speculative"]["accepted"]
        if name == "right":
            assert accepted >= 40  # most of 4 x 20 tokens came from the corpus


def test_suffix_batch_and_corpus_file(tiny_zoo, tmp_path):
    import json

    import specport

    path = tiny_zoo.artifact("llama")  # the concat layout (the engine's step on its KV cache)
    model = specport.load(path, threads=1)
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    plain = [r.tokens for r in model.generate_batch(prompt_ids=prompts, max_new_tokens=12)]
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"ids": a}) + "\n" for a in plain))
    seeded = specport.load(path, threads=1, suffix_corpus=corpus)
    assert len(seeded.suffix_index) == sum(len(a) + 1 for a in plain)
    got = seeded.generate_batch(
        prompt_ids=prompts, max_new_tokens=12, speculative="suffix", num_draft=3
    )
    assert [g.tokens for g in got] == plain and got[0].metrics["speculative"]["accepted"] > 0
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"ids": [1, 2]}\n{"tokens": [3]}\n')
    with pytest.raises(InputError, match="bad.jsonl:2"):
        specport.load(path, threads=1, suffix_corpus=bad)
    bad.write_bytes(b"\xff\xfe\n")
    with pytest.raises(InputError, match="not UTF-8"):
        specport.load(path, threads=1, suffix_corpus=bad)


def test_adding_answers_one_by_one_indexes_as_one_build():
    """A server adds an answer per finished request: merging each into the sorted arrays must
    give the index a single build gives (same matches, oldest first)."""
    rng = np.random.default_rng(1)
    seqs = [rng.integers(0, 12, size=int(rng.integers(1, 30))).tolist() for _ in range(60)]
    once, stepwise = SuffixIndex(max_n=4), SuffixIndex(max_n=4)
    once.extend(seqs)
    for seq in seqs:
        stepwise.add(seq)
        stepwise.tokens()  # index now, as a lookup between requests would
    assert stepwise.tokens().tolist() == once.tokens().tolist()
    for probe in ([3], [3, 4], [1, 2, 3], [5, 5, 5, 5], [11, 0]):
        n1, ends1 = once.longest_match(probe, 1)
        n2, ends2 = stepwise.longest_match(probe, 1)
        assert n1 == n2 and ends1.tolist() == ends2.tolist()
        assert ends1.tolist() == sorted(ends1.tolist())
