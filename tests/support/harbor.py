"""Harbor tests run where Harbor's own venv exists (`make install` makes it)."""

from __future__ import annotations

import os

import pytest

from sandbox.harbor.backend import harbor_python

needs_harbor = pytest.mark.skipif(
    not os.access(harbor_python(), os.X_OK),
    reason=f"Harbor's venv is missing ({harbor_python()}): `make install` (and so `make test`) "
           "makes it")
