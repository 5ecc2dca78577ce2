"""Artifacts run unchanged in onnxruntime-genai (and say where they do not), and carry a model card.

Every comparison is token-exact against specport's own greedy decoding on the same artifact:
genai's own search loop (which stops at EOS) against `specport generate`, and a longer
argmax loop over genai's logits (EOS ignored) against `ignore_eos=True`. The genai package is
the real one (`onnxruntime-genai`); tests skip with a reason where it is not installed.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import specport
from specport.artifact.manifest import read_manifest
from tests.fixtures import LONG_PROMPT, SHORT_PROMPT, TinyZoo

og = pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai is not installed")

PROMPTS = [SHORT_PROMPT, LONG_PROMPT]
NEW = 16
SHARED_MAX = 96


def genai_tokens(artifact: Path, prompt: list[int], n: int) -> tuple[list[int], list[int]]:
    """(genai's own greedy search, which stops at EOS; argmax of genai's logits for n tokens)."""
    model = og.Model(str(artifact))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(prompt) + n, do_sample=False)
    gen = og.Generator(model, params)
    gen.append_tokens(prompt)
    searched = []
    while not gen.is_done():
        gen.generate_next_token()
        searched.append(int(gen.get_next_tokens()[0]))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(prompt) + n + 1, do_sample=False)
    gen = og.Generator(model, params)
    gen.append_tokens(prompt)
    argmax: list[int] = []
    while len(argmax) < n:
        logits = np.asarray(gen.get_logits())
        argmax.append(int(np.argmax(logits.reshape(-1, logits.shape[-1])[-1])))
        gen.append_tokens([argmax[-1]])
    return searched, argmax


def assert_genai_equals_specport(artifact: Path) -> None:
    runtimes = read_manifest(artifact).extra["interop"]["runtimes"]
    assert runtimes["onnxruntime-genai"]["status"] == "yes", runtimes["onnxruntime-genai"]
    model = specport.load(artifact, provider="cpu", threads=1)
    for prompt in PROMPTS:
        searched, argmax = genai_tokens(artifact, prompt, NEW)
        assert (
            argmax == model.generate(prompt_ids=prompt, max_new_tokens=NEW, ignore_eos=True).tokens
        )
        stops = model.generate(prompt_ids=prompt, max_new_tokens=NEW).tokens
        assert searched == stops


@pytest.fixture(scope="module")
def shared_arts() -> dict[str, Path]:
    return {}


def shared_artifact(zoo: TinyZoo, arts: dict[str, Path], root: Path, arch: str) -> Path:
    from tests.export_cache import cached_export

    if arch not in arts:
        out = root / f"{arch}-shared"
        cached_export(
            zoo.source(arch), out, kv_layout="shared", max_length=SHARED_MAX, progress=False
        )
        arts[arch] = out
    return arts[arch]


# Every registry architecture whose cache genai can size (DeepSeek-V3's MLA cache cannot be).
ARCHS = ["llama", "mistral", "qwen2", "qwen3", "phi3", "gemma", "gpt2"]


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_genai_runs_concat_artifacts(tiny_zoo: TinyZoo, arch: str) -> None:
    assert_genai_equals_specport(tiny_zoo.artifact(arch, fuse=True))


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "gemma", "gpt2"])
def test_genai_runs_shared_artifacts(
    tiny_zoo: TinyZoo, shared_arts: dict[str, Path], tmp_path_factory, arch: str
) -> None:
    art = shared_artifact(tiny_zoo, shared_arts, tmp_path_factory.mktemp("shared"), arch)
    genai = json.loads((art / "genai_config.json").read_text())
    assert genai["search"]["past_present_share_buffer"] is True
    assert genai["model"]["context_length"] == SHARED_MAX
    assert genai["model"]["decoder"]["filename"] == "model.genai.onnx"
    assert_genai_equals_specport(art)


@pytest.mark.slow
def test_genai_refusal_is_recorded_and_specport_still_runs(tiny_zoo: TinyZoo) -> None:
    """DeepSeek-V3's MLA cache (key dim != value dim) is one genai cannot size: no config, a reason."""
    art = tiny_zoo.artifact("deepseek_v3", fuse=True)
    m = read_manifest(art)
    genai = m.extra["interop"]["runtimes"]["onnxruntime-genai"]
    assert genai["status"] == "no" and "head size" in genai["reason"]
    assert not (art / "genai_config.json").exists()
    assert "onnxruntime-genai | no |" in (art / "README.md").read_text()
    model = specport.load(art, provider="cpu", threads=1)
    assert (
        len(model.generate(prompt_ids=SHORT_PROMPT, max_new_tokens=4, ignore_eos=True).tokens) == 4
    )


@pytest.fixture(scope="module")
def quantized(tiny_zoo: TinyZoo, shared_arts: dict[str, Path], tmp_path_factory) -> dict[str, Path]:
    """w4a16 and w4a8 of the tiny Llama, both KV layouts (calibration-free rtn: seconds)."""
    root = tmp_path_factory.mktemp("quant_interop")
    sources = {
        "concat": tiny_zoo.artifact("llama", fuse=True),
        "shared": shared_artifact(tiny_zoo, shared_arts, root, "llama"),
    }
    out = {}
    for layout, src in sources.items():
        for scheme in ("w4a16", "w4a8"):
            out[f"{layout}-{scheme}"] = root / f"{layout}-{scheme}"
            specport.quantize(src, out[f"{layout}-{scheme}"], scheme=scheme, algo="rtn")
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", ["concat-w4a16", "concat-w4a8", "shared-w4a16", "shared-w4a8"])
def test_genai_runs_4bit_artifacts(quantized: dict[str, Path], name: str) -> None:
    art = quantized[name]
    m = read_manifest(art)
    assert m.quant and m.quant["scheme"] == name.split("-")[1]
    genai = json.loads((art / "genai_config.json").read_text())
    decoder = genai["model"]["decoder"]["filename"]
    assert decoder == ("model.genai.onnx" if name.startswith("shared") else "model.onnx")
    if decoder == "model.genai.onnx":  # derived from the quantized graph, not copied from fp32
        import onnx

        graph = onnx.load(str(art / decoder), load_external_data=False).graph
        assert any(n.op_type == "MatMulNBits" for n in graph.node)
    card = (art / "README.md").read_text()
    assert f"scheme {m.quant['scheme']}" in card and "not measured" in card
    assert_genai_equals_specport(art)


@pytest.fixture(scope="module")
def variants(tiny_zoo: TinyZoo, tmp_path_factory) -> dict[str, Path]:
    """Variants genai runs through model.genai.onnx or its own KV dtype: int8 KV, tree mask, MTP."""

    from tests.export_cache import cached_export, cached_mtp
    from tests.passes.quant._tiny import with_tokenizer, write_corpus

    root = tmp_path_factory.mktemp("variants")
    plain = tiny_zoo.artifact("llama", fuse=False)
    calib = write_corpus(root / "calib.txt", docs=12)
    src = with_tokenizer(plain, root / "tok")
    specport.quantize(src, root / "kv8", scheme="none", kv_cache="int8", calib_files=[calib])
    cached_export(tiny_zoo.source("llama"), root / "tree", tree_mask=True, progress=False)
    cached_mtp(plain, root / "mtp")
    return {"kv8": root / "kv8", "tree": root / "tree", "mtp": root / "mtp"}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "decoder", "optimum"),
    [
        ("kv8", "model.onnx", "no"),
        ("tree", "model.genai.onnx", "no"),
        ("mtp", "model.genai.onnx", "yes"),
    ],
)
def test_genai_runs_variants(
    variants: dict[str, Path], name: str, decoder: str, optimum: str
) -> None:
    """int8 KV: genai allocates the cache from the graph's type; tree mask and MTP: a derived graph."""
    art = variants[name]
    runtimes = read_manifest(art).extra["interop"]["runtimes"]
    assert runtimes["onnxruntime-genai"]["decoder"] == decoder
    assert runtimes["onnxruntime-genai"]["notes"], "the card must say what genai leaves out"
    assert runtimes["optimum"]["status"] == optimum
    if decoder == "model.genai.onnx":
        import onnx

        graph = onnx.load(str(art / decoder), load_external_data=False).graph
        assert {i.name for i in graph.input} <= {"input_ids", "attention_mask", "position_ids"} | {
            f"past_key_values.{i}.{p}" for i in range(2) for p in ("key", "value")
        }
        assert next(o.name for o in graph.output) == "logits" and len(graph.output) == 5
    assert_genai_equals_specport(art)


def test_model_card_and_hashes_are_consistent(tiny_llama_artifact: Path) -> None:
    from specport.artifact.model_card import is_generated

    m = read_manifest(tiny_llama_artifact)  # checks every file's sha256, the card's included
    card = (tiny_llama_artifact / "README.md").read_text()
    assert is_generated(card)
    generated = set(m.extra["interop"]["generated"])
    assert {"README.md", "genai_config.json", "config.json"} <= generated <= set(m.files)
    for name, digest in m.files.items():
        if name != "README.md":
            assert (
                f"| `{name}` | {(tiny_llama_artifact / name).stat().st_size:,} | `{digest}` |"
                in card
            )
    for heading in ("## Runs in", "## What the passes did", "## Verification against PyTorch"):
        assert heading in card
    for how in ("specport generate", "og.Model", "ORTModelForCausalLM", "ort.InferenceSession"):
        assert how in card
    hf = json.loads((tiny_llama_artifact / "config.json").read_text())
    assert hf["model_type"] == "llama" and hf["num_hidden_layers"] == 2 and hf["use_cache"]


def test_user_files_are_never_overwritten(tiny_llama_artifact: Path, tmp_path: Path) -> None:
    """A README.md the user put in an artifact survives a quantize; the card goes beside it."""
    src = tmp_path / "src"
    shutil.copytree(tiny_llama_artifact, src)
    (src / "README.md").write_text("my notes\n")
    m = read_manifest(src, check_hashes=False)
    m.extra["interop"]["generated"].remove("README.md")
    from specport.artifact.files import write_artifact_manifest

    write_artifact_manifest(src, m)
    assert (src / "README.md").read_text() == "my notes\n"
    assert "## Runs in" in (src / "MODEL_CARD.md").read_text()
    out = specport.quantize(src, tmp_path / "q", scheme="w4a16", algo="rtn")
    assert (tmp_path / "q" / "README.md").read_text() == "my notes\n"
    assert "README.md" in out.extra["interop"]["kept"]
    assert "scheme w4a16" in (tmp_path / "q" / "MODEL_CARD.md").read_text()
    read_manifest(tmp_path / "q")  # hashes cover the kept file and the card


def test_inspect_lists_runtimes(
    tiny_llama_artifact: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from specport.cli import main

    assert main(["inspect", str(tiny_llama_artifact), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert {n: r["status"] for n, r in info["runtimes"].items()} == {
        "specport": "yes",
        "onnxruntime": "yes",
        "onnxruntime-genai": "yes",
        "optimum": "yes",
    }
    assert main(["inspect", str(tiny_llama_artifact)]) == 0
    assert "runtimes" in capsys.readouterr().out


def test_write_manifest_never_fails_on_interop(tmp_path: Path) -> None:
    """A manifest with a bogus graph still writes; the runtimes it cannot serve say why."""
    from specport.artifact import manifest as art
    from specport.artifact.files import write_artifact_manifest
    from tests.exporter.test_artifact import _manifest

    (tmp_path / "model.onnx").write_bytes(b"not a graph")
    m = _manifest()
    write_artifact_manifest(tmp_path, m)
    loaded = art.read_manifest(tmp_path)
    runtimes = loaded.extra["interop"]["runtimes"]
    assert runtimes["onnxruntime-genai"]["status"] == "no"
    assert set(loaded.files) >= {"model.onnx", "README.md", "config.json"}


REFERENCE = "Once upon a time, there was a little girl named Lily. She loved to play outside"


@pytest.mark.slow
@pytest.mark.shared
@pytest.mark.parametrize("source", ["hf", "llama2c"])
def test_genai_tokenizer_and_text_on_stories260k(
    shared_path: Callable[..., Path], tmp_path: Path, source: str
) -> None:
    """The real stories260K, from its HF directory and from llama2.c: genai reads the tokenizer
    files the artifact carries, encodes the reference prompt to the same ids as specport (with
    the tokenizer's own BOS), and greedy-decodes the known reference text."""
    from tests.export_cache import cached_export

    if source == "hf":
        cached_export(shared_path("models", "stories260K"), tmp_path / "a", progress=False)
    else:
        cached_export(
            shared_path("models", "llama2c", "stories260K.bin"),
            tmp_path / "a",
            tokenizer=shared_path("models", "llama2c", "tok512.bin"),
            progress=False,
        )
    model = og.Model(str(tmp_path / "a"))
    tokenizer = og.Tokenizer(model)
    tokenizer.update_options(add_special_tokens="true")
    ids = [int(t) for t in tokenizer.encode("Once upon a time")]
    assert ids == [1, 403, 407, 261, 378]
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=40, do_sample=False)
    gen = og.Generator(model, params)
    gen.append_tokens(ids)
    while not gen.is_done():
        gen.generate_next_token()
    text = tokenizer.decode(gen.get_sequence(0))
    assert text.startswith(REFERENCE)
    ours = specport.load(tmp_path / "a", provider="cpu", threads=1)
    result = ours.generate(prompt_ids=ids, max_new_tokens=40 - len(ids))
    assert [int(t) for t in gen.get_sequence(0)][len(ids) :] == result.tokens


def test_inspect_on_an_artifact_without_interop_files(
    tiny_llama_artifact: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An artifact written before these files existed: inspect says what is missing and how."""
    from specport.artifact.manifest import write_manifest
    from specport.cli import main

    old = tmp_path / "old"
    shutil.copytree(tiny_llama_artifact, old)
    m = read_manifest(old)
    for name in m.extra.pop("interop")["generated"]:
        (old / name).unlink()
    write_manifest(old, m)
    assert main(["inspect", str(old), "--json"]) == 0
    runtimes = json.loads(capsys.readouterr().out)["runtimes"]
    assert runtimes["specport"]["status"] == "yes"
    assert "re-export" in runtimes["onnxruntime-genai"]["reason"]
    assert "re-export" in runtimes["optimum"]["reason"]


def test_tokenizer_config_compat_keeps_the_tokens() -> None:
    """transformers-5 tokenizer configs get the form transformers 4.x (Optimum's) reads too."""
    from specport.artifact.optimum_config import tokenizer_config_compat

    v5 = {"tokenizer_class": "TokenizersBackend", "extra_special_tokens": ["<s>", "</s>"]}
    assert tokenizer_config_compat(v5) == {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "additional_special_tokens": ["<s>", "</s>"],
    }
    v4 = {"tokenizer_class": "LlamaTokenizer", "extra_special_tokens": {"image": "<img>"}}
    assert tokenizer_config_compat(v4) is None
