"""Llama and its close relatives: the same decoder, other names or small config switches.

Everything a relative changes inside the decoder (SmolLM3's layers without rope, Granite's
multipliers, OLMo 2's post-norms and whole-projection q/k norm, Qwen3's per-head q/k norm) is
traced from transformers' own module, so an entry is its name plus the options it accepts.
"""

from __future__ import annotations

from specport.exporter.archs.base import ArchConfig, register_arch


@register_arch("llama")
class Llama(ArchConfig):
    # Llama 3.x frequency scaling and YaRN fix the frequencies at load time: traced exactly.
    rope_types = frozenset({"default", "llama3", "yarn"})


@register_arch("mistral")
class Mistral(Llama):
    pass


@register_arch("qwen2")
class Qwen2(Llama):
    pass


@register_arch("qwen3")
class Qwen3(Llama):
    pass


@register_arch("smollm3")
class SmolLM3(Llama):
    pass


@register_arch("granite")
class Granite(Llama):
    pass


@register_arch("olmo2")
class Olmo2(Llama):
    pass
