"""The Python API's own contract: the error family at the package root, messages that name
keyword arguments (not CLI flags), `generate(stream=True)`, per-row batch metrics, and a
`num_draft` default that fits an MTP artifact."""

from __future__ import annotations

import json
import re

import pytest

import specport
from specport.core import errors

FLAG = re.compile(r"(^|\s)--[a-z]")


def test_exception_family_at_the_package_root():
    names = [n for n in errors.__all__ if n.endswith("Error")]
    assert "SpecportError" in names and "UsageError" in names
    for name in names:
        cls = getattr(specport, name)
        assert cls is getattr(errors, name) and issubclass(cls, specport.SpecportError)
    assert specport.UsageError.exit_code == 2 and specport.ArtifactError.exit_code == 1


@pytest.fixture(scope="module")
def model(tiny_llama_artifact):
    return specport.load(tiny_llama_artifact)


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"prompt_ids": [1, 2], "max_new_tokens": 0}, "max_new_tokens"),
        ({"prompt_ids": [1, 10**6]}, "prompt_ids"),
        ({"prompt_ids": []}, "prompt_ids"),
        ({"prompt": "Once"}, "prompt_ids"),  # no tokenizer
        ({"prompt_ids": [1, 2], "speculative": "medusa"}, "speculative"),
        ({"prompt_ids": [1, 2], "speculative": "draft"}, "draft"),
        ({"prompt_ids": [1, 2], "tree_width": 2}, "tree_width"),
        ({"prompt_ids": [1, 2], "speculative": "ngram", "tree_width": 17}, "tree_width"),
        ({"prompt_ids": [1, 2], "speculative": "ngram", "num_draft": 0}, "num_draft"),
        ({"prompt_ids": [1, 2], "speculative": "mtp"}, "train-mtp"),
        ({"prompt_ids": [1, 2], "on_text": print, "stream": True}, "on_text"),
    ],
)
def test_api_messages_name_keyword_arguments(model, kwargs, words):
    with pytest.raises(specport.SpecportError) as e:
        model.generate(**kwargs)
    message = str(e.value)
    prose = re.sub(r"`[^`]*`", "", message)  # a suggested shell command may carry flags
    assert words in message and not FLAG.search(prose), message


def test_api_build_errors_name_keyword_arguments(tmp_path, tiny_llama_artifact):
    from tests.fixtures import llama_config

    src = tmp_path / "src"
    llama_config().save_pretrained(str(src))
    with pytest.raises(specport.UsageError, match="kv_layout='shared'") as e:
        specport.export(src, tmp_path / "o", kv_layout="shared", target="cann")
    assert not FLAG.search(str(e.value))
    with pytest.raises(specport.UsageError, match="passes"):
        specport.export(src, tmp_path / "o", passes=["nope"])
    with pytest.raises(specport.UsageError, match="is the input") as e:
        specport.quantize(tiny_llama_artifact, tiny_llama_artifact, scheme="w4a16")
    assert not FLAG.search(str(e.value))
    with pytest.raises(specport.UsageError, match="calib_files"):
        specport.quantize(tiny_llama_artifact, tmp_path / "q", scheme="w4a16", algo="gptq")
    with pytest.raises(specport.UsageError, match="float_zero") as e:  # no 4-bit weights
        specport.quantize(tiny_llama_artifact, tmp_path / "q", scheme="w8a16", float_zero=True)
    assert not FLAG.search(str(e.value)) and not (tmp_path / "q").exists()
    user = tmp_path / "notes.txt"
    user.write_text("x")
    with pytest.raises(specport.OutputError, match="refusing"):
        specport.export(src, user)
    assert user.read_text() == "x" and not (tmp_path / "o").exists()


def test_stream_iterator_yields_the_text(tiny_chat_artifact):
    model = specport.load(tiny_chat_artifact)
    whole = model.generate("Hello there", max_new_tokens=12, ignore_eos=True)
    stream = model.generate("Hello there", max_new_tokens=12, ignore_eos=True, stream=True)
    pieces = list(stream)
    assert len(pieces) > 1 and "".join(pieces) == whole.text
    assert stream.result.tokens == whole.tokens
    with model.generate("Hello there", max_new_tokens=12, stream=True) as early:
        first = next(iter(early))  # leave after one piece: the worker stops
    assert first == pieces[0]


def test_batch_rows_report_their_own_tokens(model):
    rows = model.generate_batch(prompt_ids=[[1, 5, 9, 5, 9], [1, 7]], max_new_tokens=6)
    assert [r.metrics["prompt_tokens"] for r in rows] == [5, 2]
    assert [r.metrics["new_tokens"] for r in rows] == [len(r.tokens) for r in rows]
    assert all(r.metrics["batch_prompt_tokens"] == 7 for r in rows)
    assert rows[0].metrics["batch_new_tokens"] == sum(len(r.tokens) for r in rows)


def test_cli_batch_json_rows(cli, tiny_llama_artifact):
    code, out, _ = cli(
        "generate", tiny_llama_artifact, "--prompt-ids", "1,5,9,5,9", "--prompt-ids", "1,7",
        "--max-new-tokens", "5", "--json",
    )  # fmt: skip
    assert code == 0
    lines = [json.loads(x) for x in out.splitlines()]
    assert [x["index"] for x in lines] == [0, 1] and lines[1]["prompt"] == "1,7"
    assert [x["metrics"]["prompt_tokens"] for x in lines] == [5, 2]


def test_num_draft_default_fits_the_mtp_heads(model):
    from specport.generation_args import resolve_num_draft

    saved = model.manifest.mtp
    model.manifest.mtp = {"heads": 3}  # as `specport train-mtp --heads 3` records it
    try:
        assert resolve_num_draft(model, "mtp", None) == 3
        assert resolve_num_draft(model, "ngram", None) == 4
        with pytest.raises(specport.UsageError, match="3 MTP heads"):
            resolve_num_draft(model, "mtp", 4)
    finally:
        model.manifest.mtp = saved


def test_the_call_checks_use_the_runtimes_methods_and_draft_limit():
    """generation_args keeps its own copies so that the CLI parses without loading the runtime
    (which cannot import the API layer): they must stay the runtime's."""
    from specport import generation_args
    from specport.runtime.speculative import loop

    assert generation_args.METHODS == loop.METHODS
    assert generation_args.MAX_DRAFT == loop.MAX_DRAFT
