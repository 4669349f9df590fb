"""Standard Webhooks signing (https://www.standardwebhooks.com): `whsec_` secrets, the
`v1` signature (HMAC-SHA256 over `id.timestamp.body`), the three `webhook-*` headers an
attempt carries, and `verify` for receivers. A receiver using the `standardwebhooks`
library verifies what the dispatcher sends, and `verify` accepts what that library sends.

Pure functions, no state and no I/O: the outbox checks secrets with them before storing a
delivery, the dispatcher signs each attempt with them, and a receiver (or a test) imports
them without the delivery machinery. Split out of `ridgeline.platform.webhooks`, which
re-exports every name here and describes the whole webhook design.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import secrets as _secrets
import time
from collections.abc import Mapping, Sequence

from ridgeline.errors import ConfigError, RidgelineError

SECRET_PREFIX = "whsec_"


class WebhookSignatureError(RidgelineError):
    """A webhook whose signature headers are missing, malformed, too old or do not match."""

    http_status = 401


# ---- signing (Standard Webhooks) -----------------------------------------------------------


def new_secret(num_bytes: int = 32) -> str:
    """A fresh signing secret, `whsec_` and base64 of random bytes."""
    return SECRET_PREFIX + base64.b64encode(_secrets.token_bytes(num_bytes)).decode("ascii")


def secret_key(secret: str) -> bytes:
    """The HMAC key a `whsec_<base64>` secret stands for (the prefix is optional)."""
    raw = secret[len(SECRET_PREFIX):] if secret.startswith(SECRET_PREFIX) else secret
    try:
        key = base64.b64decode(raw + "=" * (-len(raw) % 4), validate=True)
    except (binascii.Error, ValueError):
        key = b""
    if not key:
        raise ConfigError("a webhook secret must be 'whsec_' followed by base64 of its bytes",
                          hint="make one with ridgeline.platform.webhooks.new_secret()")
    return key


def sign(secret: str, msg_id: str, timestamp: int, body: bytes) -> str:
    """The `v1,<base64>` signature of one message: HMAC-SHA256 over `id.timestamp.body`."""
    mac = hmac.new(secret_key(secret), f"{msg_id}.{int(timestamp)}.".encode() + body,
                   hashlib.sha256)
    return "v1," + base64.b64encode(mac.digest()).decode("ascii")


def signature_header(secrets: str | Sequence[str], msg_id: str, timestamp: int,
                     body: bytes) -> str:
    """`webhook-signature`: one signature per secret, space-separated (key rotation)."""
    keys = [secrets] if isinstance(secrets, str) else list(secrets)
    return " ".join(sign(s, msg_id, timestamp, body) for s in keys)


def signed_headers(secrets: str | Sequence[str], msg_id: str, timestamp: int,
                   body: bytes) -> dict[str, str]:
    return {"webhook-id": msg_id, "webhook-timestamp": str(int(timestamp)),
            "webhook-signature": signature_header(secrets, msg_id, timestamp, body)}


def verify(secret: str | Sequence[str], headers: Mapping[str, str], body: bytes | str,
           tolerance_s: float = 300, *, now: float | None = None) -> None:
    """Check a received webhook; `WebhookSignatureError` unless a `v1` signature matches
    one of the secrets and the timestamp is within `tolerance_s` of `now`."""
    h = {k.lower(): v for k, v in headers.items()}
    msg_id, stamp, sigs = (h.get("webhook-id"), h.get("webhook-timestamp"),
                           h.get("webhook-signature"))
    if not (msg_id and stamp and sigs):
        raise WebhookSignatureError("missing webhook-id, webhook-timestamp or "
                                    "webhook-signature header")
    try:
        timestamp = int(stamp)
    except ValueError:
        raise WebhookSignatureError(f"webhook-timestamp {stamp!r} is not an integer") from None
    now = time.time() if now is None else now
    if abs(now - timestamp) > tolerance_s:
        raise WebhookSignatureError(f"webhook-timestamp is more than {tolerance_s:g} s from "
                                    "now (a replay, or the sender's clock is off)")
    data = body.encode() if isinstance(body, str) else body
    keys = [secret] if isinstance(secret, str) else list(secret)
    expected = [base64.b64decode(sign(s, msg_id, timestamp, data)[3:]) for s in keys]
    for entry in sigs.split(" "):
        version, _, encoded = entry.partition(",")
        if version != "v1":
            continue   # other schemes (v1a: asymmetric) are not ours to check
        try:
            got = base64.b64decode(encoded, validate=True)
        except (binascii.Error, ValueError):
            continue
        if any(hmac.compare_digest(got, e) for e in expected):
            return
    raise WebhookSignatureError("no webhook signature matches")
