"""`specport generate` with several prompts and the speculative options, end to end."""

import json

import pytest

from specport.cli import main

PROMPTS = ["1,5,9,5,9,5,9", "1,7", "1,3,4,3,4"]


def _generate(capsys, artifact, *extra):
    args = ["generate", str(artifact), "--max-new-tokens", "12", "--ignore-eos", "--json"]
    for p in PROMPTS:
        args += ["--prompt-ids", p]
    assert main([*args, *extra]) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.strip()]


@pytest.mark.slow
def test_batched_speculative_equals_plain_batch(capsys, tiny_llama_artifact):
    plain = _generate(capsys, tiny_llama_artifact)
    spec = _generate(capsys, tiny_llama_artifact, "--speculative", "ngram", "--num-draft", "3")
    assert len(plain) == len(spec) == len(PROMPTS)
    assert [r["tokens"] for r in spec] == [r["tokens"] for r in plain]
    assert spec[0]["metrics"]["speculative"]["method"] == "ngram"


@pytest.mark.slow
def test_tree_width_with_a_draft_model_is_refused(capsys, tiny_llama_artifact):
    rc = main(
        [
            "generate",
            str(tiny_llama_artifact),
            "--prompt-ids",
            "1,2",
            "--speculative",
            "draft",
            "--tree-width",
            "2",
        ]
    )
    assert rc == 2  # a usage error, found before the artifact loads
    assert "--tree-width needs --speculative ngram, mtp or eagle" in capsys.readouterr().err


@pytest.mark.slow
def test_tree_width_without_tree_mask_artifact_says_reexport(capsys, tiny_llama_artifact):
    rc = main(
        [
            "generate",
            str(tiny_llama_artifact),
            "--prompt-ids",
            "1,2,1,2",
            "--speculative",
            "ngram",
            "--tree-width",
            "2",
        ]
    )
    assert rc == 1
    assert "--tree-mask" in capsys.readouterr().err


def test_suffix_corpus_from_the_cli(capsys, tiny_llama_artifact, tmp_path):
    plain = _generate(capsys, tiny_llama_artifact)
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"ids": r["tokens"]}) + "\n" for r in plain))
    spec = _generate(
        capsys, tiny_llama_artifact, "--speculative", "suffix", "--suffix-corpus", str(corpus)
    )
    assert [r["tokens"] for r in spec] == [r["tokens"] for r in plain]
    assert spec[0]["metrics"]["speculative"]["method"] == "suffix"
    missing = tmp_path / "none.jsonl"
    args = ["generate", str(tiny_llama_artifact), "--prompt-ids", "1,2", "--speculative", "suffix"]
    assert main([*args, "--suffix-corpus", str(missing)]) == 1
    assert f"--suffix-corpus {missing}: no such file" in capsys.readouterr().err
