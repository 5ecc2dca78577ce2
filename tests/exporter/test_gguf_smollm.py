"""The real SmolLM2-135M-Instruct Q4_1 GGUF: the artifact reproduces the shared README's
reference greedy tokens (transformers 5.23 loading the same file) exactly."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("gguf", reason="the gguf extra is not installed (pip install 'specport[gguf]')")


GGUF = ("models", "smollm2-135m-instruct", "SmolLM2-135M-Instruct.Q4_1.gguf")
SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
HAIKU_PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018,
                411, 407, 19712, 8182, 2, 198, 1, 4093, 198, 19161, 253, 421, 30614, 563, 260,
                3426, 30, 2, 198, 1, 520, 9531, 198]  # fmt: skip
HAIKU_IDS = [504, 6147, 282, 260, 3426, 28, 253, 13879, 6122, 28, 198, 49, 9154, 303, 5082, 282,
             260, 10393, 28, 198, 49, 13151, 282, 260, 6122, 338, 5721, 8823, 28, 198, 49, 13151,
             282, 260, 5065, 506, 1149, 30, 2]  # fmt: skip
TEXTS = [
    "Once upon a time",
    "  leading and   inner   spaces\n\n\ttabs and\r\nnewlines  ",
    "héllo wörld — naïve café 日本語 🤗 ½ ∑",
    "<|im_start|>user\nhi there<|im_end|>\n<|endoftext|>",
    "def f(x):\n    return x ** 2  # 12345",
]

pytestmark = [pytest.mark.shared, pytest.mark.slow]


@pytest.fixture(scope="module")
def gguf_path(shared_path: Callable[..., Path]) -> Path:
    return shared_path(*GGUF)


@pytest.fixture(scope="module")
def smollm(gguf_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    import specport

    out = tmp_path_factory.mktemp("smollm") / "art"
    specport.export(gguf_path, out, progress=False)
    return specport.load(out)


def test_manifest_records_the_gguf_source(smollm: Any) -> None:
    manifest = json.loads((Path(smollm.path) / "specport.json").read_text())
    src = manifest["source"]
    assert src["kind"] == "gguf"
    assert src["gguf"]["sha256"] == SHA256
    assert src["gguf"]["tensor_types"] == {"F32": 61, "Q4_1": 210, "Q8_0": 1}
    assert manifest["verify"]["ok"]


def test_chat_reference_tokens(smollm: Any) -> None:
    from specport.core.chat_template import load_chat_template

    template = load_chat_template(smollm)
    assert template is not None
    ids = template.render_ids([{"role": "user", "content": "Write a haiku about the sea."}])
    assert ids == HAIKU_PROMPT
    assert smollm.generate(prompt_ids=ids, max_new_tokens=60).tokens == HAIKU_IDS
    ids = template.render_ids([{"role": "user", "content": "What is the capital of France?"}])
    result = smollm.generate(prompt_ids=ids, max_new_tokens=30)
    text = smollm.tokenizer.decode(result.tokens, skip_special_tokens=False)
    assert text == "The capital of France is Paris.<|im_end|>"


def test_plain_text_reference(smollm: Any) -> None:
    assert smollm.encode("Once upon a time") == [6403, 1980, 253, 655]
    result = smollm.generate("Once upon a time", max_new_tokens=12)
    assert result.text.startswith(", the city of Nova Haven was a thriving metropolis,")


def test_tokenizer_matches_transformers_gguf_tokenizer(smollm: Any, gguf_path: Path) -> None:
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    for text in TEXTS:
        ids = smollm.encode(text)
        assert ids == ref.encode(text), text
        assert smollm.tokenizer.decode(ids, skip_special_tokens=False) == ref.decode(ids), text


def test_the_model_writes_requests_after_its_user_header(smollm: Any, tmp_path: Path) -> None:
    """`train-draft --messages self`: sampled after the chat template's user header, the
    real chat model writes distinct user requests (most of them questions) and ends them."""
    from specport.core.chat_template import load_chat_template
    from specport.self_messages import MAX_TOKENS, self_messages

    template = load_chat_template(smollm)
    assert smollm.tokenizer.decode(template.user_prefix_ids(), skip_special_tokens=False) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        "Face<|im_end|>\n<|im_start|>user\n"
    )
    got = self_messages(smollm, template, 16, tmp_path)
    assert len(set(got)) == 16
    assert all(4 <= len(smollm.encode(m)) <= MAX_TOKENS for m in got)
    assert sum(m.endswith("?") for m in got) >= 8, got
