"""Who may open the viewer: the admin key, sent as a header or exchanged once at the login form
for a signed session cookie (HttpOnly, SameSite=Strict). A rollout key never opens it.

The cookie holds an expiry and an HMAC of it under the admin key, not the key itself: nothing
stored server-side, valid on every gateway sharing the key, and void once the key changes."""

from __future__ import annotations

import hashlib
import hmac
import time

from gateway.auth import KEY_PREFIX, check_admin, presented_key
from gateway.protocols.errors import GatewayError

COOKIE = "rolltap_ui"
LIFETIME_S = 12 * 3600


def _mac(admin_key: str, expires: int) -> str:
    message = f"rolltap-ui:{expires}".encode()
    return hmac.new(admin_key.encode(), message, hashlib.sha256).hexdigest()


def issue(admin_key: str, now: float | None = None) -> str:
    expires = int((time.time() if now is None else now) + LIFETIME_S)
    return f"{expires}.{_mac(admin_key, expires)}"


def valid(cookie: str | None, admin_key: str, now: float | None = None) -> bool:
    if not cookie or not admin_key:
        return False
    expires, _, mac = cookie.partition(".")
    if not expires.isdigit() or int(expires) < (time.time() if now is None else now):
        return False
    return hmac.compare_digest(mac.encode(), _mac(admin_key, int(expires)).encode())


def check(headers, cookies, admin_key: str) -> None:
    """Raises GatewayError 401 (no or bad credentials) or 403 (a rollout key)."""
    if presented_key(headers) is not None:
        check_admin(headers, admin_key)  # 403 for a rollout key, 401 for anything else
        return
    cookie = cookies.get(COOKIE)
    if cookie and cookie.startswith(KEY_PREFIX):
        raise GatewayError(403, "a rollout key cannot open the viewer", "permission_error")
    if not valid(cookie, admin_key):
        raise GatewayError(
            401,
            "log in at /ui with the admin key, or send `Authorization: Bearer ADMIN_KEY`",
            "authentication_error",
        )
