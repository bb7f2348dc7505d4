"""Where rolltap keeps its data by default: the embedded Postgres and its runs, shared by the
gateway and the bridge (`--data-dir`, `ROLLTAP_DATA_DIR`)."""

from __future__ import annotations

import os
from pathlib import Path


def default_data_dir() -> Path:
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(
        os.path.expanduser("~"), ".local", "share"
    )
    return Path(base) / "rolltap"
