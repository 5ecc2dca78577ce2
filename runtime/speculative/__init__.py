"""specport.runtime.speculative: proposers (draft tokens) and verifiers (accept or correct)."""

from specport.runtime.speculative.base import PAD, Drafts, Proposer, ProposerBase
from specport.runtime.speculative.metrics import SpecDecodingStats
from specport.runtime.speculative.ngram import NgramProposer
from specport.runtime.speculative.verify import (
    Verifier,
    VerifyResult,
    greedy_verify,
    make_verifier,
    rejection_verify,
)

__all__ = [
    "PAD",
    "Drafts",
    "NgramProposer",
    "Proposer",
    "ProposerBase",
    "SpecDecodingStats",
    "Verifier",
    "VerifyResult",
    "greedy_verify",
    "make_verifier",
    "rejection_verify",
]
