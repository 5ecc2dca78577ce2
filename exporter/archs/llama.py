"""Llama and its close relatives: the same decoder, other names or small config switches."""

from __future__ import annotations

from specport.exporter.registry import ArchConfig, register_arch


@register_arch("llama")
class Llama(ArchConfig):
    pass


@register_arch("mistral")
class Mistral(Llama):
    pass


@register_arch("qwen2")
class Qwen2(Llama):
    pass


@register_arch("qwen3")
class Qwen3(Llama):
    pass
