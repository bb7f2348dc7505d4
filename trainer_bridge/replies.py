"""What a replica or a gateway answered: a call that must answer 200, and one whose failure is
collected with the others (the weight sync and the version announcer both talk to many)."""

from __future__ import annotations

from collections.abc import Callable

import httpx


def ok(response: httpx.Response) -> httpx.Response:
    if response.status_code != 200:
        raise RuntimeError(
            f"{response.request.method} {response.request.url} answered "
            f"{response.status_code}: {response.text[:500]}"
        )
    return response


def attempt(call: Callable[[str], httpx.Response], url: str) -> str | None:
    """The error of `call(url)` as text, or None when it answered 200."""
    try:
        ok(call(url))
    except Exception as exc:  # collected per replica and raised together
        return str(exc)
    return None
