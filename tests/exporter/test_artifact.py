"""The artifact as a file format: atomic writes, manifest round trip, usable without specport."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from specport.artifact import manifest as art
from specport.core.errors import ArtifactError


class Boom(RuntimeError):
    pass


def _leftovers(parent: Path, name: str) -> list[Path]:
    return sorted(parent.glob(f".{name}.tmp-*")) + sorted(parent.glob(f".{name}.old-*"))


def test_atomic_dir_exception_leaves_nothing(tmp_path: Path) -> None:
    out = tmp_path / "artifact"
    with pytest.raises(Boom), art.atomic_artifact_dir(out) as tmp:
        (tmp / "model.onnx").write_bytes(b"half written")
        raise Boom("export died half way")
    assert not out.exists()
    assert _leftovers(tmp_path, "artifact") == []
    assert list(tmp_path.iterdir()) == []


def test_atomic_dir_exception_keeps_previous_artifact(tmp_path: Path) -> None:
    out = tmp_path / "artifact"
    with art.atomic_artifact_dir(out) as tmp:
        (tmp / "model.onnx").write_bytes(b"v1")
        (tmp / art.MANIFEST_NAME).write_text("{}")
    with pytest.raises(Boom), art.atomic_artifact_dir(out) as tmp:
        (tmp / "model.onnx").write_bytes(b"v2")
        raise Boom
    assert (out / "model.onnx").read_bytes() == b"v1"
    assert _leftovers(tmp_path, "artifact") == []


def test_atomic_dir_success_replaces_in_one_step(tmp_path: Path) -> None:
    out = tmp_path / "artifact"
    for version in (b"v1", b"v2"):
        with art.atomic_artifact_dir(out) as tmp:
            assert not out.exists() or (out / "model.onnx").read_bytes() == b"v1"
            (tmp / "model.onnx").write_bytes(version)
            (tmp / art.MANIFEST_NAME).write_text("{}")
    assert (out / "model.onnx").read_bytes() == b"v2"
    assert _leftovers(tmp_path, "artifact") == []


def test_atomic_dir_refuses_to_replace_foreign_directory(tmp_path: Path) -> None:
    out = tmp_path / "my_documents"
    out.mkdir()
    (out / "thesis.tex").write_text("precious")
    with (
        pytest.raises(ArtifactError, match="not a specport artifact"),
        art.atomic_artifact_dir(out),
    ):
        pass
    assert (out / "thesis.tex").read_text() == "precious"


def _manifest() -> art.Manifest:
    return art.Manifest(
        architecture="llama",
        config={"model_type": "llama", "num_layers": 2, "vocab_size": 256, "context_length": 128},
        io={
            "inputs": [
                {"name": "input_ids", "dtype": "int64", "shape": ["batch", "sequence_length"]}
            ],
            "outputs": [],
        },
        kv=art.KVLayout(
            inputs=[["past_key_values.0.key", "past_key_values.0.value"]],
            outputs=[["present.0.key", "present.0.value"]],
            num_heads=[2],
            key_dim=[16],
            value_dim=[16],
        ),
        passes=[{"name": "fuse_rms_norm", "modified": True}],
        verify={"ok": True, "max_abs_logits": 1e-6},
        extra={"future_key": {"nested": [1, 2, 3]}},
    )


def test_manifest_round_trip(tmp_path: Path) -> None:
    (tmp_path / "model.onnx").write_bytes(b"graph")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "w.bin").write_bytes(b"weights")
    original = _manifest()
    art.write_manifest(tmp_path, original)  # the other runtimes' files: test_interop
    data = json.loads((tmp_path / art.MANIFEST_NAME).read_text())
    assert data["future_key"] == {"nested": [1, 2, 3]}  # extra keys live at the top level
    assert set(data["files"]) == {"model.onnx", "sub/w.bin"}
    loaded = art.read_manifest(tmp_path)
    assert loaded == original
    assert loaded.to_json() == original.to_json()
    assert (loaded.num_layers, loaded.vocab_size, loaded.context_length) == (2, 256, 128)


def test_manifest_of_real_artifact_round_trips(tiny_llama_artifact: Path) -> None:
    manifest = art.read_manifest(tiny_llama_artifact)
    assert manifest.schema_version == art.SCHEMA_VERSION
    assert manifest.verify["ok"] is True
    assert set(manifest.files) >= {art.MODEL_NAME, art.DATA_NAME}
    again = art.Manifest.from_json(json.loads(json.dumps(manifest.to_json())))
    assert again == manifest


BARE_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    import onnxruntime as ort

    art, ids = sys.argv[1], json.loads(sys.argv[2])
    manifest = json.load(open(art + "/specport.json"))
    sess = ort.InferenceSession(art + "/" + manifest["model_file"], providers=["CPUExecutionProvider"])
    kv = manifest["kv"]
    feeds = {
        "input_ids": np.array([ids], np.int64),
        "attention_mask": np.ones((1, len(ids)), np.int64),
        "position_ids": np.arange(len(ids), dtype=np.int64)[None],
    }
    for (k, v), h, kd, vd in zip(kv["inputs"], kv["num_heads"], kv["key_dim"], kv["value_dim"]):
        feeds[k] = np.zeros((1, h, 0, kd), np.float32)
        feeds[v] = np.zeros((1, h, 0, vd), np.float32)
    names = [o.name for o in sess.get_outputs()]
    out = sess.run(names, feeds)
    # One decode step, feeding the graph's own present KV back.
    nxt = int(out[0][0, -1].argmax())
    feeds2 = {
        "input_ids": np.array([[nxt]], np.int64),
        "attention_mask": np.ones((1, len(ids) + 1), np.int64),
        "position_ids": np.array([[len(ids)]], np.int64),
    }
    for i, (k, v) in enumerate(kv["inputs"]):
        feeds2[k], feeds2[v] = out[names.index(kv["outputs"][i][0])], out[names.index(kv["outputs"][i][1])]
    out2 = sess.run(["logits"], feeds2)
    assert not any(m == "specport" or m.startswith("specport.") for m in sys.modules)
    np.save(sys.argv[3], np.concatenate([out[0][0], out2[0][0]], axis=0))
    """
)


def test_bare_onnxruntime_runs_artifact(tiny_zoo, tmp_path: Path) -> None:
    """model.onnx is a plain ONNX model: onnxruntime alone runs prefill + decode correctly."""
    artifact = tiny_zoo.artifact("llama", fuse=False)
    ids = [1, 17, 93, 5, 44]
    script = tmp_path / "bare.py"
    script.write_text(BARE_SCRIPT)
    out_file = tmp_path / "logits.npy"
    proc = subprocess.run(
        [sys.executable, "-I", str(script), str(artifact), json.dumps(ids), str(out_file)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    ort_logits = np.load(out_file)  # [S + 1, V]: prefill rows then the decode step
    model = tiny_zoo.reference("llama")
    nxt = int(ort_logits[len(ids) - 1].argmax())
    with torch.no_grad():
        ref = model(torch.tensor([[*ids, nxt]])).logits[0].numpy()
    np.testing.assert_allclose(ort_logits, ref, atol=1e-4, rtol=1e-4)
