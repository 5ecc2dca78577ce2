"""The built-in demo model: trained on first use, then reused from the cache.

`specport demo` must run with no network and no model of the user's, so it trains a tiny Llama
on the synthetic story corpus (about 90 s on 2 CPU cores) and keeps the result as a regular
Hugging Face directory under `cache_dir() / "demo-model-v1"`. The directory is written to a
temporary sibling and renamed into place, so an interrupted run never leaves a half-written
model that a later run would trust.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

from specport.core.errors import SpecportError
from specport.core.settings import cache_dir
from specport.samples.trainer import DemoTrainConfig, save_hf_model_dir, train_demo_model

logger = logging.getLogger(__name__)

DEMO_MODEL_NAME = "demo-model-v1"
DEMO_PROMPT = "Once upon a time"
REQUIRED_FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
)
_INFO_FILE = "demo_train.json"


def demo_model_dir() -> Path:
    """Where the demo model lives (whether or not it has been trained yet)."""
    return cache_dir() / DEMO_MODEL_NAME


def is_complete(path: Path) -> bool:
    """True when `path` holds every file of a demo model directory."""
    return all(
        (path / name).is_file() and (path / name).stat().st_size > 0 for name in REQUIRED_FILES
    )


def ensure_demo_model(
    progress: bool | None = True, force: bool = False, config: DemoTrainConfig | None = None
) -> Path:
    """Return the demo model's Hugging Face directory, training it first if needed.

    `force` retrains even when a cached model exists. `config` overrides the training sizes and
    budgets (tests use a tiny step budget); a cached model is reused whatever its config was.
    """
    target = demo_model_dir()
    if not force and is_complete(target):
        logger.debug("reusing demo model at %s", target)
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{DEMO_MODEL_NAME}-", dir=target.parent))
    except OSError as exc:
        raise SpecportError(
            f"cannot write the demo model under {target.parent} ({exc}): "
            "set SPECPORT_CACHE to a writable folder."
        ) from exc
    try:
        logger.info("training the demo model (first run only, about a minute on 2 CPU cores)")
        model, tok, result = train_demo_model(config, progress=progress)
        save_hf_model_dir(model, tok, tmp)
        info = {
            "steps": result.steps,
            "final_loss": result.final_loss,
            "seconds": result.seconds,
            "tokens_seen": result.tokens_seen,
            "prompt": DEMO_PROMPT,
        }
        (tmp / _INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")
        _replace_dir(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    logger.info("demo model ready at %s", target)
    return target


def _replace_dir(src: Path, target: Path) -> None:
    """Move `src` to `target`, replacing an old or partial `target` (rename is atomic)."""
    if target.exists():
        old = target.with_name(f".{target.name}-old-{os.getpid()}")
        target.rename(old)
        shutil.rmtree(old, ignore_errors=True)
    try:
        src.rename(target)
    except OSError:
        # Another process finished first: keep its model if it is complete, else retry ours.
        if is_complete(target):
            return
        shutil.rmtree(target, ignore_errors=True)
        src.rename(target)
