"""New weights back to the engines, through TRL's `weight_transfer` seam (`init_weight_transfer`,
`pause`, `send_weights`, `resume`, `destroy`; TRL calls `pause`, `send_weights`, `resume` once per
push, the first time before training starts):

- `DiskWeightSync` writes the weights as a safetensors checkpoint directory that every vLLM
  replica can read (trainer_bridge/checkpoints.py), then pauses each replica (`/pause?mode=keep`:
  requests freeze, they are not aborted), reloads it in place (`/collective_rpc`
  `reload_weights`), drops its prefix cache (computed by the old weights) and resumes it. It
  works on the CPU build and with any number of replicas.
- On GPUs, TRL's own NCCL transfer (`WeightTransferClient`) streams into one vLLM;
  `NcclWeightSync` wraps it so a failed send does not leave that vLLM paused, its prefix cache
  is dropped like the disk path's, its side of the transfer is shut down at the end, and every
  `state_every`th push also writes a resumable checkpoint to disk.

Either is wrapped in a `VersionedTransfer` (trainer_bridge/versions.py), which announces the
new version to the gateways.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import torch

from trainer_bridge.checkpoints import (
    check_names,
    checkpoint_names,
    next_checkpoint,
    prune_checkpoints,
    remove_partial_checkpoints,
    send_and_write,
    ties_embeddings,
    write_checkpoint,
)
from trainer_bridge.replies import attempt, ok

log = logging.getLogger(__name__)


class WeightSyncError(RuntimeError):
    """The engines cannot take the trainer's weights as configured; the message says why."""


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
        tied = ties_embeddings(self.model_dir)
        for url in self.vllm_urls:
            response = self._http.get(f"{url}/server_info", params={"config_format": "json"})
            if response.status_code == 404:
                raise WeightSyncError(
                    f"vLLM at {url} has no /server_info: start it with VLLM_SERVER_DEV_MODE=1 "
                    "(rolltap serve-model does), which the pause and reload endpoints need too"
                )
            device = ok(response).json()["vllm_config"]["device_config"]["device"]
            if tied and device == "cpu":
                # vLLM's CPU build prepacks the LM head's weight for its GEMM kernel when the
                # model loads. An in-place reload repacks the layers it loads, and a tied head
                # loads nothing of its own (its name is skipped), so the engine would keep
                # sampling through the original head while the embeddings move (vLLM 0.32).
                raise WeightSyncError(
                    f"{self.model_dir} ties its LM head to its embeddings, and vLLM's CPU build "
                    f"(at {url}) does not refresh a tied head when it reloads weights in place. "
                    "Serve and train an untied copy of it, made by "
                    "trainer_bridge.checkpoints.untie_embeddings(MODEL_DIR, DEST)."
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

        dest = next_checkpoint(self.checkpoint_dir)
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
        prune_checkpoints(self.checkpoint_dir, self.keep, self.resumable, self.protected)

    def _reload(self, url: str, dest: Path) -> httpx.Response:
        ok(
            self._http.post(
                f"{url}/collective_rpc",
                json={"method": "reload_weights", "kwargs": {"weights_path": str(dest)}},
            )
        )
        return reset_prefix_cache(self._http, url)

    def resume(self) -> None:
        self._all("resume", lambda url: self._http.post(f"{url}/resume"))

    def destroy(self) -> None:
        self._pool.shutdown()
        self._http.close()

    def _on_all(self, call) -> list[str]:
        """`call(url)` on every replica at once; the failures, as `url: error`."""
        results = self._pool.map(lambda url: attempt(call, url), self.vllm_urls)
        return [f"{url}: {err}" for url, err in zip(self.vllm_urls, results) if err]

    def _all(self, what: str, call) -> None:
        if errors := self._on_all(call):
            raise RuntimeError(f"weight sync: {what} failed on " + "; ".join(errors))

def reset_prefix_cache(http: httpx.Client, url: str) -> httpx.Response:
    # Cached prefixes hold keys and values the old weights computed, and a pause in `keep` mode
    # leaves them in place. Requests frozen by the pause are recomputed under the new weights as
    # they resume.
    response = ok(
        http.post(f"{url}/reset_prefix_cache", params={"reset_running_requests": "true"})
    )
    if not response.json().get("success", False):
        raise RuntimeError(f"vLLM at {url} could not reset its prefix cache")
    return response


class StateCheckpoints:
    """Resumable checkpoints of a sync that writes none of its own (NCCL): every push `due()`
    says, the weights it sends, with `add_state` adding the trainer's state; the newest `keep`
    are kept, and the `protected` ones (the checkpoint the bridge resumed from)."""

    def __init__(self, model_dir: str | os.PathLike, checkpoint_dir: str | os.PathLike, *,
                 due: Callable[[], bool], keep: int = 2,
                 protected: Iterable[str | os.PathLike] = ()) -> None:
        self.model_dir = Path(model_dir)
        self.checkpoint_dir = Path(checkpoint_dir).resolve()
        self.due, self.keep = due, keep
        self.protected = {Path(p).resolve() for p in protected}
        self.add_state: Callable[[Path], None] | None = None
        self.latest: Path | None = None

    def write_while(self, iterator: Iterator[tuple[str, torch.Tensor]],
                    send: Callable[[Iterator[tuple[str, torch.Tensor]]], None]) -> None:
        dest = next_checkpoint(self.checkpoint_dir)
        self.latest = send_and_write(iterator, send, self.model_dir, dest, extra=self.add_state)
        prune_checkpoints(self.checkpoint_dir, self.keep, lambda path: False, self.protected)


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

    With `state` (a `StateCheckpoints`), a push that `state.due()` also writes what it sends as
    a checkpoint in `state.checkpoint_dir` from the same pass, with the trainer's state added
    (`state.add_state`): the NCCL path's checkpoints to resume from.
    """

    def __init__(self, inner, vllm_url: str, timeout: float = 300,
                 state: StateCheckpoints | None = None) -> None:
        self.inner = inner
        self.url = vllm_url.rstrip("/")
        self.state = state
        self._http = httpx.Client(timeout=timeout)

    def init_weight_transfer(self) -> None:
        if self.state is not None:
            self.state.checkpoint_dir.mkdir(parents=True, exist_ok=True)
            remove_partial_checkpoints(self.state.checkpoint_dir)
        self.inner.init_weight_transfer()
        print(f"rolltap bridge: NCCL weight transfer to {self.url} initialised", flush=True)

    def pause(self) -> None:
        self.inner.pause()

    def send_weights(self, iterator: Iterator[tuple[str, torch.Tensor]]) -> None:
        try:
            if self.state is not None and self.state.due():
                self.state.write_while(iterator, self.inner.send_weights)
            else:
                self.inner.send_weights(iterator)
            reset_prefix_cache(self._http, self.url)
        except BaseException:
            if error := attempt(lambda url: self._http.post(f"{url}/resume"), self.url):
                log.error("weight sync: could not resume %s after a failed send: %s",
                          self.url, error)
            raise

    def resume(self) -> None:
        self.inner.resume()

    def destroy(self) -> None:
        try:
            if error := attempt(
                lambda url: self._http.post(f"{url}/shutdown_weight_transfer_engine"), self.url
            ):
                # The run is over either way; a later bridge's init reports it if it matters.
                log.error("weight sync: could not shut down the transfer engine of %s: %s",
                          self.url, error)
        finally:
            self.inner.destroy()
            self._http.close()
