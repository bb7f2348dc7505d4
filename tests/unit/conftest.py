"""The unit lane: tests that start nothing. No vLLM, Postgres, gateway or sandbox, no child
process and no connection beyond this machine; `make test-unit` runs them in a few minutes.

Two guards keep the lane honest: a unit test that asks for a fixture of the other lanes (the
plugins of tests/fixtures/) fails before it runs, and one that starts a process or connects
to another host fails at that call. A test that trips either belongs in tests/integration."""

from __future__ import annotations

import asyncio
import importlib
import ipaddress
import os
import socket
import subprocess

import pytest

from tests.fixtures import PLUGINS

# The other lanes' fixtures: those the plugins of tests/fixtures/ provide.
OTHER_LANES = {name: plugin for plugin in PLUGINS
               for name in importlib.import_module(plugin).__all__}


class StartsSomething(AssertionError):
    """A unit test started a process or reached beyond this machine."""


def _refuse(what: str):
    def refuse(*args, **kwargs):
        raise StartsSomething(f"a unit test must not {what}: move it to tests/integration")

    return refuse


def _loopback(address) -> bool:
    if not isinstance(address, tuple):  # a Unix socket path
        return True
    host = address[0]
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: resolving it is already beyond this machine
        return False


def pytest_runtest_setup(item):
    """Before any fixture is set up, so a borrowed vLLM is not even started."""
    borrowed = sorted(f"{name} ({OTHER_LANES[name]})" for name in item.fixturenames
                      if name in OTHER_LANES)
    if borrowed:
        raise StartsSomething(f"a unit test uses fixtures of the other lanes: "
                              f"{', '.join(borrowed)}; move it to tests/integration")


@pytest.fixture(autouse=True)
def _starts_nothing(monkeypatch):
    monkeypatch.setattr(subprocess.Popen, "__init__", _refuse("start a process"))
    monkeypatch.setattr(asyncio, "create_subprocess_exec", _refuse("start a process"))
    monkeypatch.setattr(asyncio, "create_subprocess_shell", _refuse("start a process"))
    monkeypatch.setattr(os, "posix_spawn", _refuse("start a process"))
    monkeypatch.setattr(os, "posix_spawnp", _refuse("start a process"))
    monkeypatch.setattr(os, "fork", _refuse("fork"))
    connect = socket.socket.connect

    def local_only(sock, address):
        if not _loopback(address):
            raise StartsSomething(f"a unit test must not connect to {address}")
        return connect(sock, address)

    monkeypatch.setattr(socket.socket, "connect", local_only)
