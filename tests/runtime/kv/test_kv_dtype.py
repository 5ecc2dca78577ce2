"""KV caches in the graph's dtype: a float16 artifact generates through every runtime path.

The generator, the batching engine (shared layout, continuous batching), n-gram speculation and
the OpenAI-compatible server all allocate their caches from `manifest.kv.dtype`, which
`align_kv_dtype` sets from the session's past input; a bfloat16 artifact is refused with one line.
"""

from __future__ import annotations

import pytest

import specport
from specport.artifact.manifest import KVLayout, Manifest
from specport.core.errors import ArtifactError
from specport.runtime.kv.layouts import align_kv_dtype, check_runtime_dtype

PROMPTS = [[1, 74, 75, 76, 90], [1, 100], [1, 5, 6, 7, 8, 9, 10, 11, 12]]


@pytest.fixture(scope="module")
def fp16_shared(tiny_zoo, tmp_path_factory):
    from tests.export_cache import cached_export

    out = tmp_path_factory.mktemp("kv_fp16") / "art"
    # target cuda: the float16 KV cache (a cpu-target artifact keeps attention in float32);
    # it runs on the CPU provider too
    cached_export(
        tiny_zoo.source("llama"),
        out,
        kv_layout="shared",
        target="cuda",
        dtype="fp16",
        progress=False,
    )
    return out


@pytest.mark.slow
def test_kv_dtype_is_read_from_the_graph(fp16_shared):
    model = specport.load(fp16_shared, threads=1)
    assert model.manifest.kv.dtype == "float16"
    model.manifest.kv.dtype = "float32"  # a manifest that disagrees with its graph
    assert align_kv_dtype(model.session, model.manifest) == "float16"
    r = model.generate(prompt_ids=PROMPTS[0], max_new_tokens=8, ignore_eos=True)
    assert r.metrics["io_binding"] and len(r.tokens) == 8


@pytest.mark.slow
def test_fp16_engine_speculation_and_server_agree_with_generate(fp16_shared):
    from specport.runtime.engine import make_engine
    from tests.runtime.serve.helpers import openai_client, serve

    model = specport.load(fp16_shared, threads=1)
    singles = [
        model.generate(prompt_ids=p, max_new_tokens=10, ignore_eos=True).tokens for p in PROMPTS
    ]
    spec = model.generate(
        prompt_ids=PROMPTS[2], max_new_tokens=10, ignore_eos=True, speculative="ngram"
    )
    assert spec.tokens == singles[2]  # greedy speculation equals plain greedy exactly
    engine = make_engine(model, max_batch=4, kind="auto")
    server = serve(model, engine, model_name="tiny16")
    try:
        client = openai_client(server)
        for prompt, want in zip(PROMPTS, singles):
            out = client.completions.create(
                model="tiny16",
                prompt=prompt,
                max_tokens=10,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            assert out.choices[0].token_ids == want
    finally:
        server.stop()
        engine.close()


def test_bfloat16_artifact_is_refused_in_one_line():
    manifest = Manifest("llama", {}, {}, KVLayout(dtype="bfloat16"), dtype="bfloat16")
    with pytest.raises(ArtifactError, match="bfloat16 artifact.*re-export with --dtype fp16"):
        check_runtime_dtype(manifest, "ART")
    check_runtime_dtype(Manifest("llama", {}, {}, KVLayout(dtype="float16"), dtype="float16"))
