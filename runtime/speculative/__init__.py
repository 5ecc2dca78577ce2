"""specport.runtime.speculative: proposers (draft tokens) and verifiers (accept or correct)."""
