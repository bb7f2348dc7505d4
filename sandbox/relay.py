"""The gateway, and nothing else, inside a sandbox's network namespace.

A confined sandbox has only a loopback interface. Its one way out is a Unix socket bound into
it (confine.GATEWAY_SOCKET). Inside, socat listens on 127.0.0.1:PORT and forwards every
connection to that socket, so the harness gets an ordinary `http://127.0.0.1:PORT` base URL.
Outside, the socket is either the gateway's own (`rolltap gateway --unix-socket PATH`) or, when
the runner knows the gateway only by its TCP URL (another machine, a Ray node), a `Relay` the
runner serves for the sandbox, which connects each stream to that URL's host and port. Either
way the sandbox reaches exactly the gateway, and there only what a rollout key may do.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import tempfile
from collections.abc import Sequence
from urllib.parse import urlsplit, urlunsplit

from sandbox.confine import GATEWAY_SOCKET

# Waits for socat's listening socket (in /proc/net/tcp of the sandbox's own namespace) before
# the harness starts, so its first call never meets a closed port.
FORWARD_SCRIPT = """\
socat TCP-LISTEN:"$1",bind=127.0.0.1,fork,reuseaddr UNIX-CONNECT:"$2" &
hex=$(printf '%04X' "$1"); shift 2; tries=0
until grep -q ":$hex 00000000:0000 0A" /proc/net/tcp; do
  tries=$((tries + 1))
  if [ "$tries" -gt 1000 ]; then
    echo "rolltap: the gateway forwarder did not start" >&2; exit 125
  fi
  sleep 0.01
done
exec "$@"
"""
BUFFER = 1 << 16


# Where the forwarder listens when the gateway's own port is one only root may bind.
FALLBACK_PORT = 8080


def url_port(url: str) -> int:
    parts = urlsplit(url)
    return parts.port or (443 if parts.scheme == "https" else 80)


def inside_port(url: str) -> int:
    """The gateway's port, kept inside where the sandbox (no capabilities) may listen on it."""
    port = url_port(url)
    return port if port >= 1024 else FALLBACK_PORT


def inside_url(url: str) -> str:
    """`url` as the sandbox reaches it: same scheme and path, on its own loopback."""
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, f"127.0.0.1:{inside_port(url)}", parts.path, parts.query,
                       parts.fragment))


def forwarded(argv: list[str], port: int, shell: Sequence[str] = ("/bin/sh",),
              prelude: str = "") -> list[str]:
    """`argv` started behind the in-sandbox forwarder on 127.0.0.1:`port`. In a task image,
    `shell` and `prelude` make the script and its tools the host's (hostexec.py)."""
    return [*shell, "-c", prelude + FORWARD_SCRIPT, "rolltap-forward", str(port),
            GATEWAY_SOCKET, *argv]


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(BUFFER):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        with contextlib.suppress(OSError, RuntimeError):
            if writer.can_write_eof():
                writer.write_eof()


class Relay:
    """A Unix socket at `path` whose every connection is a TCP stream to `host`:`port`."""

    def __init__(self, path: str, host: str, port: int) -> None:
        self.path, self.host, self.port = path, host, port
        self._server: asyncio.AbstractServer | None = None
        self._streams: set[asyncio.Task] = set()

    @classmethod
    async def start(cls, url: str) -> Relay:
        """A relay to `url`'s server, on a socket in a fresh private directory (a short path:
        Unix socket paths are limited to 107 bytes)."""
        parts = urlsplit(url)
        path = os.path.join(tempfile.mkdtemp(prefix="rolltap-gw-"), "gateway.sock")
        relay = cls(path, parts.hostname or "127.0.0.1", url_port(url))
        relay._server = await asyncio.start_unix_server(relay._serve, path)
        # The sandbox's uid is none of the runner's; connecting needs write permission.
        os.chmod(path, 0o666)
        return relay

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._streams.add(task)
        try:
            try:
                up_reader, up_writer = await asyncio.open_connection(self.host, self.port)
            except OSError:
                return
            try:
                await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
            finally:
                up_writer.close()
        finally:
            writer.close()
            self._streams.discard(task)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._streams):
            task.cancel()
        await asyncio.gather(*self._streams, return_exceptions=True)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
            os.rmdir(os.path.dirname(self.path))
