"""The shared fixtures, one plugin module each (tests/fixtures/): a real vLLM (CPU build, the
project's tiny model), a fresh Postgres database, the session's gateway process, the base image
of task-image tests. Tests of tests/unit use none of them (tests/unit/conftest.py checks).

Hypothesis runs without its per-example deadline: a deadline is a timing assertion, and on a
loaded machine it fails tests whose property holds (speed lives in `make bench`)."""

from hypothesis import settings

from tests.fixtures import PLUGINS

settings.register_profile("rolltap", deadline=None)
settings.load_profile("rolltap")

pytest_plugins = PLUGINS
