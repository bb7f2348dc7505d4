"""Weights back to the engines: the checkpoint the disk sync writes, the name check, untying a
tied head (vLLM's CPU build cannot refresh one in place, so the sync refuses it), announcing
versions to several gateways, and the CLI's refusals. Pushing into live replicas is in
test_bridge_e2e.py, which serves an untied copy of the tiny model."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest
import torch
from safetensors.torch import load_file

from tests.support.gateway import ADMIN_KEY, GatewayProcess
from trainer_bridge.checkpoints import (
    check_names,
    checkpoint_names,
    prune_checkpoints,
    remove_partial_checkpoints,
    untie_embeddings,
    write_checkpoint,
)
from trainer_bridge.versions import PolicyAnnouncer
from trainer_bridge.weights import DiskWeightSync, WeightSyncError


def _model_dir(tmp_path):
    src = tmp_path / "model"
    src.mkdir()
    (src / "config.json").write_text('{"model_type": "test"}')
    (src / "tokenizer.json").write_text("{}")
    (src / "model.safetensors").write_bytes(b"old weights")
    (src / "model.safetensors.index.json").write_text("{}")
    return src


def _tensors():
    gen = torch.Generator().manual_seed(0)
    return {f"layer.{i}.weight": torch.randn(64, 32, generator=gen) for i in range(6)}


def test_checkpoint_in_shards_with_an_index_and_the_models_other_files(tmp_path):
    tensors = _tensors()
    dest = write_checkpoint(iter(tensors.items()), _model_dir(tmp_path), tmp_path / "policy-1",
                            shard_bytes=3 * 64 * 32 * 4)
    names = sorted(p.name for p in dest.iterdir())
    assert names == ["config.json", "model-00001.safetensors", "model-00002.safetensors",
                     "model.safetensors.index.json", "tokenizer.json"]
    index = json.loads((dest / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(tensors)
    loaded = {}
    for shard in set(index["weight_map"].values()):
        loaded.update(load_file(str(dest / shard)))
    assert loaded.keys() == tensors.keys()
    assert all(torch.equal(loaded[k], v) for k, v in tensors.items())
    assert not list(tmp_path.glob(".*partial"))


def test_small_checkpoint_is_one_file(tmp_path):
    tensors = _tensors()
    dest = write_checkpoint(iter(tensors.items()), _model_dir(tmp_path), tmp_path / "policy-1")
    assert sorted(p.name for p in dest.iterdir()) == [
        "config.json", "model.safetensors", "tokenizer.json"]
    loaded = load_file(str(dest / "model.safetensors"))
    assert all(torch.equal(loaded[k], v) for k, v in tensors.items())
    assert checkpoint_names(dest) == set(tensors)


def test_a_parameter_sent_twice_is_an_error(tmp_path):
    tensor = torch.zeros(2)
    with pytest.raises(ValueError, match="twice"):
        write_checkpoint(iter([("a", tensor), ("a", tensor)]), _model_dir(tmp_path),
                         tmp_path / "policy-1")


def test_names_must_be_the_checkpoints_except_a_tied_head():
    original = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    check_names({"model.embed_tokens.weight", "model.norm.weight"}, original)
    check_names(original, original)
    with pytest.raises(ValueError, match="not sent"):
        check_names({"model.embed_tokens.weight"}, original)
    with pytest.raises(ValueError, match="unknown"):
        check_names(original | {"base_model.model.norm.weight"}, original)


def test_untied_copy_computes_the_same_function(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    untied = untie_embeddings(tiny_model_dir, tmp_path / "untied")
    assert json.loads((untied / "config.json").read_text())["tie_word_embeddings"] is False
    tied_model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    untied_model = AutoModelForCausalLM.from_pretrained(untied, dtype=torch.float32)
    assert tied_model.lm_head.weight is tied_model.model.embed_tokens.weight
    assert untied_model.lm_head.weight is not untied_model.model.embed_tokens.weight
    assert "lm_head.weight" in checkpoint_names(untied)
    ids = torch.arange(5, 60).unsqueeze(0)
    with torch.no_grad():
        torch.testing.assert_close(untied_model(ids).logits, tied_model(ids).logits)


def test_disk_sync_refuses_a_tied_head_on_the_cpu_build(vllm_server, tmp_path):
    # The session's vLLM serves the tied tiny model on the CPU build.
    sync = DiskWeightSync(vllm_server.model_dir, tmp_path / "weights", [vllm_server.url])
    with pytest.raises(WeightSyncError, match="untie_embeddings"):
        sync.init_weight_transfer()
    sync.destroy()


def test_versions_reach_every_gateway_on_top_of_the_highest(
    gateway, vllm_server, database_url, tmp_path
):
    second = GatewayProcess([vllm_server.url], database_url,
                            log_path=tmp_path / "second.log").start()
    try:
        admin = httpx.Client(headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=30)
        assert admin.post(f"{gateway.url}/admin/policy", json={"version": 40}).status_code == 200
        # The second gateway learnt 40 from Postgres (NOTIFY); the offset is the highest held.
        announcer = PolicyAnnouncer.from_gateways([gateway.url, second.url], ADMIN_KEY)
        assert announcer.offset == 40
        assert announcer.announce(1) == 41 and announcer.announce(2) == 42
        for url in (gateway.url, second.url):
            assert admin.get(f"{url}/admin/policy").json()["version"] == 42
        assert announcer.announced == [41, 42]
    finally:
        second.stop()


def _bridge(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainer_bridge.cli", "bridge", *args],
                          capture_output=True, text=True, timeout=300)


def test_every_option_is_documented():
    import argparse

    from trainer_bridge import cli

    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers())
    [bridge] = parser._subparsers._group_actions[0].choices.values()
    options = [a for a in bridge._actions if a.option_strings and a.dest != "help"]
    assert len(options) > 20
    assert [a.option_strings for a in options if not a.help] == []
    text = _bridge("--help").stdout
    assert all(a.option_strings[0] in text for a in options)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_nccl_sync_is_refused_without_cuda(tmp_path):
    result = _bridge("--model", str(tmp_path), "--vllm", "http://127.0.0.1:1", "--gateway",
                     "http://127.0.0.1:1", "--admin-key", "k", "--max-steps", "1",
                     "--weight-sync", "nccl")
    assert result.returncode == 2
    assert "needs CUDA" in result.stderr and "--weight-sync disk" in result.stderr


def test_bridge_stops_with_a_clear_error_before_touching_a_tied_cpu_model(
    gateway, vllm_server, database_url, tmp_path
):
    admin = httpx.Client(headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=30)
    version = admin.get(f"{gateway.url}/admin/policy").json()["version"]
    result = _bridge("--model", str(vllm_server.model_dir), "--vllm", vllm_server.url,
                     "--gateway", gateway.url, "--admin-key", ADMIN_KEY,
                     "--database-url", database_url, "--max-steps", "1",
                     "--match", f"run={tmp_path.name}", "--output-dir", str(tmp_path))
    assert result.returncode == 1, result.stderr[-3000:]
    assert "untie_embeddings" in result.stderr and "Traceback" not in result.stderr
    # Refused before the first push: no weights written, no version announced.
    assert not list((tmp_path / "weights").glob("policy-*"))
    assert admin.get(f"{gateway.url}/admin/policy").json()["version"] == version


def _checkpoints(root, indexes, resumable=()):
    for i in indexes:
        (root / f"policy-{i:06d}").mkdir(parents=True)
        if i in resumable:
            (root / f"policy-{i:06d}" / "state").write_text("")


def test_pruning_keeps_the_newest_the_last_resumable_and_the_model_it_started_from(tmp_path):
    root = tmp_path / "ckpt"
    _checkpoints(root, range(1, 8), resumable={2, 4})
    prune_checkpoints(root, 2, lambda p: (p / "state").exists(),
                      {(root / "policy-000001").resolve()})
    assert sorted(p.name for p in root.iterdir()) == [
        "policy-000001", "policy-000004", "policy-000006", "policy-000007"]
    # Started from a checkpoint in the directory (--model): DiskWeightSync protects that one.
    sync = DiskWeightSync(root / "policy-000006", root, ["http://127.0.0.1:9"], keep=1)
    prune_checkpoints(root, sync.keep, sync.resumable, sync.protected)
    assert sorted(p.name for p in root.iterdir()) == ["policy-000006", "policy-000007"]


def test_partial_checkpoints_a_crash_left_are_removed(tmp_path):
    (tmp_path / ".policy-000003.partial").mkdir()
    (tmp_path / ".policy-000003.partial" / "model.safetensors").write_bytes(b"half")
    _checkpoints(tmp_path, [2])
    assert [p.name for p in remove_partial_checkpoints(tmp_path)] == [".policy-000003.partial"]
    assert [p.name for p in tmp_path.iterdir()] == ["policy-000002"]
