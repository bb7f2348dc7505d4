"""SmolLM2-135M-Instruct, converted once per converter source and kept under `.cache/`."""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from pathlib import Path

from stack import smol_model
from tests.support.vllm import CACHE_DIR

WHEEL_CACHE = CACHE_DIR / "smollm2-wheel"


def build_cached_smol_model() -> Path:
    """The converted model under `.cache/`, rebuilt only when the converter's source changes
    (the wheel itself is pinned by its sha256, so the source names it too)."""
    import transformers

    source = Path(smol_model.__file__).read_bytes()
    key = hashlib.sha256(source + transformers.__version__.encode()).hexdigest()[:16]
    target = CACHE_DIR / f"smol-model-{key}"
    if (target / smol_model.MARKER).exists():
        return target
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    # Built in a private directory and renamed, so concurrent sessions never see half a model.
    staging = Path(tempfile.mkdtemp(prefix=f".smol-model-{key}-", dir=CACHE_DIR))
    smol_model.build_smol_model(staging / "model", WHEEL_CACHE)
    try:
        (staging / "model").rename(target)
    except OSError:  # another session won the race with the same build
        pass
    shutil.rmtree(staging, ignore_errors=True)
    return target
