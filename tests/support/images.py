"""The test base image: made from Debian's packages by mmdebstrap (`rolltap image base`), once
per package list; it stays in the machine's containers-storage across test runs, mmdebstrap's
tarball in `.cache/image-base` and its unpacked root in `.cache/images`."""

from __future__ import annotations

import hashlib
import json
import os

import pytest

from sandbox import images
from tests.support.gateway import REPO

KEY = hashlib.sha256(json.dumps([images.BASE_SUITE, images.BASE_PACKAGES]).encode()).hexdigest()
BASE_TAG = f"localhost/rolltap-test-base:{KEY[:12]}"
# mmdebstrap's output, kept: a machine whose containers-storage lost the image rebuilds it
# offline from here.
TARBALL = REPO / ".cache" / "image-base" / f"{KEY[:12]}.tar"


def build_base_image() -> str:
    """The base image's tag, built if missing (the `base_image` fixture of
    tests/fixtures/images.py)."""
    if os.geteuid() != 0:
        pytest.skip("image overlays need root")
    if images.inspect(BASE_TAG) is None:
        images.base_image(BASE_TAG, keep=str(TARBALL))
    return BASE_TAG

