"""`--ray-resource NAME=N`: Ray's resources mapping, or an error naming the bad flag."""

from __future__ import annotations

import argparse

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sandbox.backends.ray import ray_resource

NAMES = st.text(st.characters(whitelist_categories=("L", "N"), whitelist_characters="_-"),
                min_size=1, max_size=12)
AMOUNTS = st.floats(min_value=1e-3, max_value=1e6, allow_nan=False)


@given(st.dictionaries(NAMES, AMOUNTS, max_size=4))
def test_flags_become_the_mapping(resources):
    specs = [f"{name}={amount!r}" for name, amount in resources.items()]
    assert dict(map(ray_resource, specs)) == resources


@pytest.mark.parametrize("spec", ["sandbox", "=1", "sandbox=", "sandbox=x", "sandbox=0",
                                  "sandbox=-2", "sandbox=nan", "sandbox=inf"])
def test_a_bad_flag_is_named(spec):
    with pytest.raises(argparse.ArgumentTypeError, match=f"'{spec}': write NAME=AMOUNT"):
        ray_resource(spec)
