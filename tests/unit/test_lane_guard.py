"""The unit lane's guard (tests/unit/conftest.py) refuses what a unit test must not do, at the
call, before anything starts or anything leaves this machine."""

from __future__ import annotations

import asyncio
import multiprocessing
import socket
import subprocess

import pytest

REFUSED_PROCESS = "a unit test must not (start a process|fork)"


def test_a_child_process_is_refused():
    with pytest.raises(AssertionError, match=REFUSED_PROCESS):
        subprocess.run(["true"], check=True)
    with pytest.raises(AssertionError, match=REFUSED_PROCESS):
        multiprocessing.get_context("fork").Process(target=print).start()


async def test_an_asyncio_child_process_is_refused():
    with pytest.raises(AssertionError, match=REFUSED_PROCESS):
        await asyncio.create_subprocess_exec("true")


def test_only_this_machine_is_reachable():
    with socket.socket() as sock, pytest.raises(AssertionError, match="must not connect"):
        sock.settimeout(1)  # without the guard: fail soon, not hang
        sock.connect(("192.0.2.1", 80))  # TEST-NET-1: nothing answers there anyway
    with socket.socket() as server, socket.socket() as client:
        server.bind(("127.0.0.1", 0))
        server.listen()
        client.connect(server.getsockname())
