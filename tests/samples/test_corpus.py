"""The demo corpus is deterministic, varied and made of short stories."""

from __future__ import annotations

import pytest

from specport.core.corpus import generate_corpus


def test_same_seed_same_corpus():
    assert generate_corpus(50, seed=3) == generate_corpus(50, seed=3)
    assert generate_corpus(50, seed=3) != generate_corpus(50, seed=4)
    assert generate_corpus(10) == generate_corpus(20)[:10]


def test_stories_are_short_and_varied():
    docs = generate_corpus(500)
    assert len(docs) == 500 and len(set(docs)) > 450
    for doc in docs:
        assert 3 <= doc.count(".") <= 6, doc
        assert doc[0].isupper() and doc.endswith(".")
    assert sum(doc.startswith("Once upon a time") for doc in docs) > 100


def test_bad_size():
    assert generate_corpus(0) == []
    with pytest.raises(ValueError):
        generate_corpus(-1)
