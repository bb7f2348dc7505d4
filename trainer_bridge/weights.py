"""New weights back to the engines, and the new policy version to the gateways.

Both halves plug into TRL's `weight_transfer` seam (`init_weight_transfer`, `pause`,
`send_weights`, `resume`, `destroy`; TRL calls `pause`, `send_weights`, `resume` once per push,
the first time before training starts):

- `DiskWeightSync` writes the weights as a safetensors checkpoint directory that every vLLM
  replica can read, then pauses each replica (`/pause?mode=keep`: requests freeze, they are not
  aborted), reloads it in place (`/collective_rpc` `reload_weights`), drops its prefix cache
  (computed by the old weights) and resumes it. It works on the CPU build and with any number of
  replicas. On GPUs, TRL's own NCCL transfer (`WeightTransferClient`) streams into one vLLM;
  `NcclWeightSync` wraps it so a failed send does not leave that vLLM paused, its prefix cache
  is dropped like the disk path's, and its side of the transfer is shut down at the end.
- `VersionedTransfer` wraps either and tells every gateway the new version while the engines are
  still paused, so no token sampled by the new weights is stamped with the old version. With a
  `PauseLease` it leases the pause from every gateway for the length of the push, so an engine
  whose bridge dies mid-push is resumed by the gateways within the lease.

Versions: TRL counts pushes from 1; the gateways get `offset` + that count, where `offset` is the
highest version any gateway had when the run began, so versions only ever grow across runs.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import shutil
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import asyncpg
import httpx
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

from core.store import rollouts as rollouts_store
from trainer_bridge.faults import crash_point

log = logging.getLogger(__name__)

# Files of a model directory that are weights; everything else (config, tokenizer, chat
# template, generation config) is copied into each checkpoint so it is a complete model.
_WEIGHT_FILE = re.compile(r".*\.(safetensors|bin|pt|pth|gguf)$|.*\.index\.json$")
_CHECKPOINT = re.compile(r"policy-(\d+)$")
_SINGLE_FILE = "model.safetensors"
_INDEX_FILE = "model.safetensors.index.json"


class WeightSyncError(RuntimeError):
    """The engines cannot take the trainer's weights as configured; the message says why."""


class PolicyAnnouncer:
    """Sets the policy version: in Postgres (with `database_url`), whose NOTIFY reaches every
    gateway on that database, and on each listed gateway (`POST /admin/policy`), which has it
    before this returns."""

    def __init__(
        self,
        gateways: Iterable[str],
        admin_key: str,
        offset: int,
        timeout: float = 60,
        policies: dict[str, dict] | None = None,
        database_url: str | None = None,
    ):
        self.gateways = [g.rstrip("/") for g in gateways]
        self.offset = offset
        self.policies = policies or {}  # each gateway's GET /admin/policy at the start
        self.database_url = database_url
        self.announced: list[int] = []  # gateway versions, in order
        self._http = httpx.Client(
            timeout=timeout, headers={"Authorization": f"Bearer {admin_key}"}
        )

    @classmethod
    def from_gateways(cls, gateways: Iterable[str], admin_key: str) -> PolicyAnnouncer:
        """An announcer whose offset is the highest version the gateways hold now."""
        gateways = [g.rstrip("/") for g in gateways]
        with httpx.Client(timeout=30, headers={"Authorization": f"Bearer {admin_key}"}) as http:
            policies = {g: _ok(http.get(f"{g}/admin/policy")).json() for g in gateways}
        offset = max(p["version"] for p in policies.values())
        return cls(gateways, admin_key, offset, policies=policies)

    def use_database(self, database_url: str) -> None:
        """Announce through Postgres too (every gateway on it hears the NOTIFY); the offset
        rises to the version stored there if that is higher."""
        self.database_url = database_url
        self.offset = max(self.offset, _in_database(database_url, rollouts_store.policy_version))

    def announce(self, trainer_version: int) -> int:
        """Stamp new tokens with the gateway version of `trainer_version`; returns it."""
        version = self.offset + trainer_version
        if self.database_url:
            _in_database(self.database_url, rollouts_store.set_policy_version, version)
        for gateway in self.gateways:
            _ok(self._http.post(f"{gateway}/admin/policy", json={"version": version}))
        self.announced.append(version)
        return version


def gateway_upstreams(gateways: Iterable[str], admin_key: str,
                      timeout: float = 30) -> dict[str, list[str]]:
    """The vLLM replicas each gateway routes to, as its `GET /admin/upstreams` names them."""
    with httpx.Client(timeout=timeout, headers={"Authorization": f"Bearer {admin_key}"}) as http:
        return {g: [u["url"] for u in _ok(http.get(f"{g.rstrip('/')}/admin/upstreams"))
                    .json()["upstreams"]]
                for g in gateways}


def unsynced_upstreams(
    upstreams: dict[str, Iterable[str]], vllm_urls: Iterable[str]
) -> list[tuple[str, str]]:
    """(gateway, replica) pairs where the gateway routes to a replica the bridge does not push
    weights to: that replica keeps its weights while the gateway stamps new versions on what it
    samples. URLs are compared as written, up to a trailing slash, so one replica reached under
    two names is reported too."""
    synced = {url.rstrip("/") for url in vllm_urls}
    return [(gateway, url) for gateway, urls in upstreams.items() for url in urls
            if url.rstrip("/") not in synced]


class PauseLease:
    """A bridge's lease, on every gateway, of the pause of its replicas: taken before a push
    pauses them, renewed every third of `seconds` while it lasts, ended after they resume. A
    bridge that dies stops renewing, and the gateways resume its replicas when it runs out.
    A gateway that cannot be reached is logged, not fatal: the push goes on unleased."""

    def __init__(self, gateways: Iterable[str], admin_key: str, replicas: Iterable[str],
                 seconds: float) -> None:
        self.gateways = [g.rstrip("/") for g in gateways]
        self.replicas = [r.rstrip("/") for r in replicas]
        self.seconds = seconds
        self._http = httpx.Client(timeout=max(seconds / 3, 1.0),
                                  headers={"Authorization": f"Bearer {admin_key}"})
        self._stopped = threading.Event()
        self._renewer: threading.Thread | None = None

    def _post(self, seconds: float) -> None:
        for gateway in self.gateways:
            for url in self.replicas:
                body = {"url": url, "seconds": seconds}
                if error := _attempt(lambda g, body=body: self._http.post(
                        f"{g}/admin/upstreams/pause-lease", json=body), gateway):
                    log.warning("weight sync: pause lease of %s on %s: %s", url, gateway, error)

    def _renew(self) -> None:
        while not self._stopped.wait(self.seconds / 3):
            self._post(self.seconds)

    def take(self) -> None:
        if self._renewer is not None:
            return
        self._post(self.seconds)
        self._stopped.clear()
        self._renewer = threading.Thread(target=self._renew, name="rolltap-pause-lease",
                                         daemon=True)
        self._renewer.start()

    def give_back(self) -> None:
        if self._renewer is None:
            return
        self._stopped.set()
        self._renewer.join()
        self._renewer = None
        self._post(0)

    def close(self) -> None:
        self.give_back()
        self._http.close()


class VersionedTransfer:
    """A weight transfer that announces each pushed version before the engines resume, holding
    a `PauseLease` (if given) from the pause to the resume."""

    def __init__(self, inner, announcer: PolicyAnnouncer, lease: PauseLease | None = None) -> None:
        self.inner = inner
        self.announcer = announcer
        self.lease = lease
        self.pushes = 0  # TRL's model_version after the push in flight

    def init_weight_transfer(self) -> None:
        self.inner.init_weight_transfer()

    def pause(self) -> None:
        if self.lease:
            self.lease.take()
        self.inner.pause()

    def send_weights(self, iterator: Iterator[tuple[str, torch.Tensor]]) -> None:
        try:
            self.inner.send_weights(iterator)
        except BaseException:
            # The inner sync resumed the engines on its way out.
            if self.lease:
                self.lease.give_back()
            raise
        # TRL bumps its version exactly once per send, right after `resume`.
        self.pushes += 1

    def resume(self) -> None:
        try:
            self.announcer.announce(self.pushes)
            crash_point("after_announce")
        finally:
            # A gateway that cannot be told fails the run, but the engines must not stay
            # frozen for the harnesses still talking to them.
            try:
                self.inner.resume()
            finally:
                if self.lease:
                    self.lease.give_back()

    def destroy(self) -> None:
        try:
            self.inner.destroy()
        finally:
            if self.lease:
                self.lease.close()


def _in_database(dsn: str, query, *args):
    """Runs one store query on its own connection, from synchronous trainer code (in a thread:
    the caller may itself be inside an event loop)."""

    async def run():
        conn = await asyncpg.connect(dsn)
        try:
            return await query(conn, *args)
        finally:
            await conn.close()

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, run()).result()


def _ok(response: httpx.Response) -> httpx.Response:
    if response.status_code != 200:
        raise RuntimeError(
            f"{response.request.method} {response.request.url} answered "
            f"{response.status_code}: {response.text[:500]}"
        )
    return response


def checkpoint_index(path: Path) -> int | None:
    match = _CHECKPOINT.match(path.name)
    return int(match.group(1)) if match else None


def write_checkpoint(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    model_dir: Path,
    dest: Path,
    shard_bytes: int = 2 << 30,
    extra: Callable[[Path], None] | None = None,
) -> Path:
    """Write a complete model directory at `dest`: the weights as safetensors, the model's other
    files copied, then whatever `extra(directory)` adds (the trainer's state). It appears at once
    (written beside it, then renamed), so a reader never sees a partial one. Tensors stream in
    and are written in shards of about `shard_bytes`, so at most one shard is held in memory; a
    checkpoint of several shards gets an index file."""
    partial = dest.with_name(f".{dest.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    for item in Path(model_dir).iterdir():
        if item.is_file() and not _WEIGHT_FILE.fullmatch(item.name):
            shutil.copy2(item, partial / item.name)
    shard: dict[str, torch.Tensor] = {}
    files: list[str] = []
    weight_map: dict[str, str] = {}
    size = 0

    def flush() -> None:
        files.append(f"model-{len(files) + 1:05d}.safetensors")
        save_file(shard, str(partial / files[-1]), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, files[-1]))
        shard.clear()

    for name, tensor in named_tensors:
        if name in weight_map or name in shard:
            raise ValueError(f"parameter {name!r} sent twice")
        shard[name] = tensor.detach().to("cpu").contiguous()
        size += tensor.numel() * tensor.element_size()
        if size >= shard_bytes:
            flush()
            size = 0
    if shard or not files:
        flush()
    if len(files) == 1:
        (partial / files[0]).rename(partial / _SINGLE_FILE)
    else:
        index = {"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}
        (partial / _INDEX_FILE).write_text(json.dumps(index, indent=2))
    if extra is not None:
        extra(partial)
    partial.rename(dest)
    return dest


def remove_partial_checkpoints(checkpoint_dir: Path) -> list[Path]:
    """Remove the checkpoints a crash left half written (`write_checkpoint`'s partial ones)."""
    partials = list(Path(checkpoint_dir).glob(".policy-*.partial"))
    for partial in partials:
        log.warning("weight sync: removing %s, a checkpoint a crash left unfinished", partial)
        shutil.rmtree(partial)
    return partials


def _ties_embeddings(model_dir: Path) -> bool:
    config = AutoConfig.from_pretrained(str(model_dir)).get_text_config()
    return bool(getattr(config, "tie_word_embeddings", False))


def untie_embeddings(model_dir: str | os.PathLike, dest: str | os.PathLike) -> Path:
    """Copy a model whose LM head is tied to its input embeddings into `dest`, with the head
    as a weight of its own (starting equal to the embeddings): the same model, but one whose
    head an in-place reload can update on vLLM's CPU build."""
    src, dest = Path(model_dir), Path(dest)
    shutil.copytree(src, dest)
    config_path = dest / "config.json"
    config = json.loads(config_path.read_text())
    config["tie_word_embeddings"] = False
    if isinstance(config.get("text_config"), dict):
        config["text_config"]["tie_word_embeddings"] = False
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    index_path = dest / _INDEX_FILE
    if index_path.exists():
        index = json.loads(index_path.read_text())
        weight_map = index["weight_map"]
        embed = next(name for name in weight_map if name.endswith("embed_tokens.weight"))
        head = load_file(str(dest / weight_map[embed]))[embed].clone()
        save_file({"lm_head.weight": head}, str(dest / "lm_head.safetensors"),
                  metadata={"format": "pt"})
        weight_map["lm_head.weight"] = "lm_head.safetensors"
        index_path.write_text(json.dumps(index, indent=2))
    else:
        # A single-file model stays a single file: loaders read only model.safetensors then.
        tensors = load_file(str(dest / _SINGLE_FILE))
        embed = next(name for name in tensors if name.endswith("embed_tokens.weight"))
        tensors["lm_head.weight"] = tensors[embed].clone()
        save_file(tensors, str(dest / _SINGLE_FILE), metadata={"format": "pt"})
    return dest


def checkpoint_names(model_dir: Path) -> set[str]:
    """Tensor names of a model directory's safetensors weights."""
    names: set[str] = set()
    for path in Path(model_dir).glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as f:
            names.update(f.keys())
    return names


def check_names(sent: set[str], original: set[str]) -> None:
    """The pushed names must be the model's own checkpoint names, or vLLM would silently keep
    the tensors it finds no match for. Only a tied head may be absent from what the trainer
    sends (the engine ties it to the embeddings itself)."""
    unknown = sent - original
    missing = original - sent - {"lm_head.weight"}
    if unknown or missing:
        raise ValueError(
            "the trainer's parameter names do not match the model's checkpoint: "
            f"unknown to the checkpoint {sorted(unknown)[:8]}, not sent {sorted(missing)[:8]}"
        )


class DiskWeightSync:
    """Weight transfer through a checkpoint directory and vLLM's in-place reload (module doc).

    Checkpoints go to `checkpoint_dir/policy-NNNNNN/`, numbered on from whatever is there;
    `add_state(directory)`, when set, adds the trainer's state to each before it appears. The
    newest `keep` are kept (the last one is the trained model, ready to serve), and so are the
    newest one `resumable` says a bridge can resume from and the `protected` ones (the model
    the bridge was started from). Partial checkpoints a crash left are removed at start. The
    directory must be readable by every replica under the same path.
    """

    def __init__(
        self,
        model_dir: str | os.PathLike,
        checkpoint_dir: str | os.PathLike,
        vllm_urls: Iterable[str],
        *,
        keep: int = 2,
        timeout: float = 1800,
        resumable: Callable[[Path], bool] = lambda path: False,
        protected: Iterable[str | os.PathLike] = (),
    ) -> None:
        if keep < 1:
            raise ValueError("keep at least one checkpoint: the replicas read the newest")
        self.model_dir = Path(model_dir)
        self.checkpoint_dir = Path(checkpoint_dir).resolve()
        self.vllm_urls = [u.rstrip("/") for u in vllm_urls]
        if not self.vllm_urls:
            raise ValueError("no vLLM replica to sync")
        self.keep = keep
        self.resumable = resumable
        self.protected = {Path(p).resolve() for p in [model_dir, *protected]}
        self.add_state: Callable[[Path], None] | None = None
        self.latest: Path | None = None
        self._http = httpx.Client(timeout=timeout)
        self._pool = ThreadPoolExecutor(max_workers=len(self.vllm_urls))
        self._original_names = checkpoint_names(self.model_dir)

    def init_weight_transfer(self) -> None:
        self.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        remove_partial_checkpoints(self.checkpoint_dir)
        tied = _ties_embeddings(self.model_dir)
        for url in self.vllm_urls:
            response = self._http.get(f"{url}/server_info", params={"config_format": "json"})
            if response.status_code == 404:
                raise WeightSyncError(
                    f"vLLM at {url} has no /server_info: start it with VLLM_SERVER_DEV_MODE=1 "
                    "(rolltap serve-model does), which the pause and reload endpoints need too"
                )
            device = _ok(response).json()["vllm_config"]["device_config"]["device"]
            if tied and device == "cpu":
                # vLLM's CPU build prepacks the LM head's weight for its GEMM kernel when the
                # model loads. An in-place reload repacks the layers it loads, and a tied head
                # loads nothing of its own (its name is skipped), so the engine would keep
                # sampling through the original head while the embeddings move (vLLM 0.32).
                raise WeightSyncError(
                    f"{self.model_dir} ties its LM head to its embeddings, and vLLM's CPU build "
                    f"(at {url}) does not refresh a tied head when it reloads weights in place. "
                    "Serve and train an untied copy of it, made by "
                    "trainer_bridge.weights.untie_embeddings(MODEL_DIR, DEST)."
                )

    def pause(self) -> None:
        # Pausing waits until the checkpoint is on disk (in `send_weights`): writing a large
        # model takes long and the engines keep serving the old policy meanwhile.
        pass

    def send_weights(self, iterator: Iterator[tuple[str, torch.Tensor]]) -> None:
        sent: set[str] = set()

        def tracked():
            for name, tensor in iterator:
                sent.add(name)
                yield name, tensor

        existing = [i for p in self.checkpoint_dir.iterdir() if (i := checkpoint_index(p))]
        dest = self.checkpoint_dir / f"policy-{max(existing, default=0) + 1:06d}"
        write_checkpoint(tracked(), self.model_dir, dest, extra=self.add_state)
        check_names(sent, self._original_names)
        try:
            self._all("pause", lambda url: self._http.post(f"{url}/pause", params={"mode": "keep"}))
            self._all("reload", lambda url: self._reload(url, dest))
        except BaseException:
            # Leave the engines serving (the old weights, or a failed reload's) rather than
            # frozen: the run is over, the harnesses are not.
            for error in self._on_all(lambda url: self._http.post(f"{url}/resume")):
                log.error("weight sync: could not resume %s", error)
            raise
        self.latest = dest
        self._prune()

    def _reload(self, url: str, dest: Path) -> httpx.Response:
        _ok(
            self._http.post(
                f"{url}/collective_rpc",
                json={"method": "reload_weights", "kwargs": {"weights_path": str(dest)}},
            )
        )
        return _reset_prefix_cache(self._http, url)

    def resume(self) -> None:
        self._all("resume", lambda url: self._http.post(f"{url}/resume"))

    def destroy(self) -> None:
        self._pool.shutdown()
        self._http.close()

    def _on_all(self, call) -> list[str]:
        """`call(url)` on every replica at once; the failures, as `url: error`."""
        results = self._pool.map(lambda url: _attempt(call, url), self.vllm_urls)
        return [f"{url}: {err}" for url, err in zip(self.vllm_urls, results) if err]

    def _all(self, what: str, call) -> None:
        if errors := self._on_all(call):
            raise RuntimeError(f"weight sync: {what} failed on " + "; ".join(errors))

    def _prune(self) -> None:
        checkpoints = sorted(
            (p for p in self.checkpoint_dir.iterdir() if checkpoint_index(p)),
            key=checkpoint_index,
        )
        resumable = [p for p in checkpoints if self.resumable(p)]
        kept = {*checkpoints[-self.keep:], *resumable[-1:]}
        for path in checkpoints:
            if path not in kept and path.resolve() not in self.protected:
                shutil.rmtree(path, ignore_errors=True)


def _reset_prefix_cache(http: httpx.Client, url: str) -> httpx.Response:
    # Cached prefixes hold keys and values the old weights computed, and a pause in `keep` mode
    # leaves them in place. Requests frozen by the pause are recomputed under the new weights as
    # they resume.
    response = _ok(
        http.post(f"{url}/reset_prefix_cache", params={"reset_running_requests": "true"})
    )
    if not response.json().get("success", False):
        raise RuntimeError(f"vLLM at {url} could not reset its prefix cache")
    return response


class NcclWeightSync:
    """TRL's NCCL transfer into one vLLM (`inner`, a `WeightTransferClient`), made safe to fail
    and to end.

    TRL calls `pause`, `send_weights`, `resume` in sequence with no `finally`, so a send that
    fails would leave the engine paused and every harness talking to it frozen: here the engine
    is resumed (still serving the weights it had, or a partial update: the error ends the run,
    and the next run's first push re-sends every parameter). After a successful send the prefix
    cache is dropped, as the disk path does. `destroy` shuts the engine's side of the transfer
    down (`/shutdown_weight_transfer_engine`), which TRL's client never does, so a restarted
    bridge can join the same vLLM again.
    """

    def __init__(self, inner, vllm_url: str, timeout: float = 300) -> None:
        self.inner = inner
        self.url = vllm_url.rstrip("/")
        self._http = httpx.Client(timeout=timeout)

    def init_weight_transfer(self) -> None:
        self.inner.init_weight_transfer()
        print(f"rolltap bridge: NCCL weight transfer to {self.url} initialised", flush=True)

    def pause(self) -> None:
        self.inner.pause()

    def send_weights(self, iterator: Iterator[tuple[str, torch.Tensor]]) -> None:
        try:
            self.inner.send_weights(iterator)
            _reset_prefix_cache(self._http, self.url)
        except BaseException:
            if error := _attempt(lambda url: self._http.post(f"{url}/resume"), self.url):
                log.error("weight sync: could not resume %s after a failed send: %s",
                          self.url, error)
            raise

    def resume(self) -> None:
        self.inner.resume()

    def destroy(self) -> None:
        try:
            if error := _attempt(
                lambda url: self._http.post(f"{url}/shutdown_weight_transfer_engine"), self.url
            ):
                # The run is over either way; a later bridge's init reports it if it matters.
                log.error("weight sync: could not shut down the transfer engine of %s: %s",
                          self.url, error)
        finally:
            self.inner.destroy()
            self._http.close()


def _attempt(call, url: str) -> str | None:
    """The error of `call(url)` as text, or None when it answered 200."""
    try:
        _ok(call(url))
    except Exception as exc:  # collected per replica and raised together
        return str(exc)
    return None
