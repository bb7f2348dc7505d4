"""Shared fixtures: a real vLLM (CPU build, the project's tiny model), a fresh Postgres
database, and real gateway processes."""

from tests.support.gateway import *  # noqa: F403
from tests.support.postgres import *  # noqa: F403
from tests.support.vllm import *  # noqa: F403
