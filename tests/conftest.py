"""The shared fixtures, one plugin module each (tests/fixtures/): a real vLLM (CPU build, the
project's tiny model), a fresh Postgres database, the session's gateway process, the base image
of task-image tests. Tests of tests/unit use none of them (tests/unit/conftest.py checks)."""

from tests.fixtures import PLUGINS

pytest_plugins = PLUGINS
