"""Fuse rotary embeddings into specport.RotaryEmbedding.

Matches ai.onnx RotaryEmbedding-23 with 4-D input [B, H, S, Dh] and cos/sin [B, S, R/2]
(torch dynamo export of Llama-family RoPE, full or partial). Interleaved (GPT-J) layout and
the 3-D packed form are left alone and reported. Contract: custom_ops/rotary_embedding.py.
"""

from __future__ import annotations

import logging

from onnxscript.rewriter import pattern as orp

from specport.custom_ops import DOMAIN
from specport.passes._rules import ReasonedRule, RuleFusionPass

logger = logging.getLogger(__name__)


class StandardRotaryFusion(ReasonedRule):
    def pattern(self, op, x, cos, sin):
        return op.RotaryEmbedding(x, cos, sin, _allow_other_attributes=True, _outputs=["y"])

    def check(self, context, x, cos, sin, y, **_):
        node = y.producer()
        if len(node.inputs) > 3 and node.inputs[3] is not None:
            return self.fail("position_ids input (cos/sin caches) form not supported", y)
        if node.attributes.get_int("interleaved", 0):
            return self.fail("interleaved rotary layout not supported", y)
        if x.shape is None or x.shape.rank() != 4:
            return self.fail("input is not 4-D [B, H, S, Dh]", x)
        if cos.shape is not None and cos.shape.rank() != 3:
            return self.fail("cos is not 3-D [B, S, R/2]", cos)
        rdim = node.attributes.get_int("rotary_embedding_dim", 0)
        half = cos.shape[-1] if cos.shape is not None else None
        if rdim and isinstance(half, int) and rdim != 2 * half:
            return self.fail(f"rotary_embedding_dim {rdim} != 2 * cos width {half}", cos)
        return orp.MatchResult()

    def rewrite(self, op, x, cos, sin, **_):
        return op.RotaryEmbedding(x, cos, sin, _domain=DOMAIN)


class FuseRotaryPass(RuleFusionPass):
    name = "fuse_rotary"
    anchors = ("RotaryEmbedding",)

    def make_rules(self):
        return [StandardRotaryFusion(name="standard_rotary")]
