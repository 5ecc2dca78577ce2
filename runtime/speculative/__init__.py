"""specport.runtime.speculative: proposers (draft tokens) and verifiers (accept or correct)."""

from specport.runtime.speculative.base import PAD, Drafts, Proposer
from specport.runtime.speculative.metrics import SpecDecodingStats
from specport.runtime.speculative.ngram import NgramProposer
from specport.runtime.speculative.verify import VerifyResult, greedy_verify, rejection_verify

__all__ = [
    "PAD",
    "Drafts",
    "NgramProposer",
    "Proposer",
    "SpecDecodingStats",
    "VerifyResult",
    "greedy_verify",
    "rejection_verify",
]
