"""The test base image: made from Debian's packages by mmdebstrap (`rolltap image base`), once
per package list; it stays in the machine's containers-storage across test runs, and its root
filesystem in `.cache/images`."""

from __future__ import annotations

import hashlib
import json
import os

import pytest

from sandbox import images

BASE_TAG = "localhost/rolltap-test-base:" + hashlib.sha256(
    json.dumps([images.BASE_SUITE, images.BASE_PACKAGES]).encode()).hexdigest()[:12]


def build_base_image() -> str:
    """The `base_image` fixture: `base_image = pytest.fixture(...)(build_base_image)` in a test
    module (session-scoped, under a name of its own so it shadows nothing)."""
    if os.geteuid() != 0:
        pytest.skip("image overlays need root")
    if images.inspect(BASE_TAG) is None:
        images.base_image(BASE_TAG)
    return BASE_TAG


base_image_fixture = pytest.fixture(scope="session", name="base_image")(build_base_image)
