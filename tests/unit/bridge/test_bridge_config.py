"""BridgeConfig: every knob from a flag or its ROLLTAP_* variable (flags win), one object."""

from __future__ import annotations

import argparse
import json

import pytest

from trainer_bridge.config import BridgeConfig

REQUIRED = ("model", "vllm", "gateway", "max_steps")


def _parse(argv, monkeypatch, **env):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    parser = argparse.ArgumentParser()
    BridgeConfig.add_arguments(parser, required=REQUIRED)
    return BridgeConfig.from_args(parser.parse_args(argv))


def test_flags_environment_and_defaults(monkeypatch):
    config = _parse(
        ["--model", "m", "--vllm", "http://a", "--vllm", "http://b", "--max-steps", "3",
         "--set", "seed=1", "--set", "epsilon_high=1.0", "--match", "run=x",
         "--no-std-scaling", "--importance-sampling", "tis", "--tis-cap", "3"],
        monkeypatch,
        ROLLTAP_GATEWAY="http://g1,http://g2", ROLLTAP_TEMPERATURE="0.7",
        ROLLTAP_LEASE_SECONDS="9", ROLLTAP_MAX_STEPS="99", ROLLTAP_ADMIN_KEY="secret",
    )
    assert config.vllm == ["http://a", "http://b"] and config.gateway == ["http://g1", "http://g2"]
    assert config.max_steps == 3  # the flag wins over ROLLTAP_MAX_STEPS
    assert config.temperature == 0.7 and config.lease_seconds == 9.0
    assert config.overrides == {"seed": 1, "epsilon_high": 1.0} and config.match == {"run": "x"}
    assert not config.std_scaling and config.importance_sampling == "tis"
    assert config.num_generations == 8  # the default
    source = config.source_config("postgresql://db", version_offset=4)
    assert (source.lease_s, source.scale_std, source.version_offset) == (9.0, False, 4)
    shown = config.to_dict()
    assert shown["admin_key"] == "<set>" and json.loads(json.dumps(shown)) == shown
    assert config.to_dict(redact=False)["admin_key"] == "secret"


def test_required_knobs_may_come_from_the_environment(monkeypatch):
    config = _parse([], monkeypatch, ROLLTAP_MODEL="m", ROLLTAP_VLLM="http://a",
                    ROLLTAP_GATEWAY="http://g", ROLLTAP_MAX_STEPS="5")
    assert (config.model, config.vllm, config.max_steps) == ("m", ["http://a"], 5)
    for name in ("ROLLTAP_VLLM", "ROLLTAP_GATEWAY", "ROLLTAP_MAX_STEPS"):
        monkeypatch.delenv(name)
    with pytest.raises(SystemExit):
        _parse(["--model", "m"], monkeypatch)  # no vllm, gateway or max-steps anywhere


def test_bad_values_are_refused():
    with pytest.raises(ValueError, match="tis_cap"):
        BridgeConfig(tis_cap=0)
    with pytest.raises(ValueError, match="temperature"):
        BridgeConfig(temperature=0)
