"""HMAC tokens for internal RPCs. A token binds the method it is for, the time it was
made and a random nonce: ``v1.<unix ms>.<nonce>.<hmac-sha256(secret, v1.ms.nonce.method)>``.
The verifier accepts each token once, within MAX_SKEW_S of its time, for its method
only, so a token seen on the wire cannot be used for another call."""
from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
import time
from collections import OrderedDict

MAX_SKEW_S = 60.0
_REPLAY_MEMORY = 200_000


def _mac(secret: bytes, ms: str, nonce: str, method: str) -> str:
    return hmac.new(secret, f"v1.{ms}.{nonce}.{method}".encode(), hashlib.sha256).hexdigest()


def mint(secret: bytes, method: str, now: float | None = None) -> str:
    ms = str(int((time.time() if now is None else now) * 1000))
    nonce = secrets.token_hex(12)
    return f"v1.{ms}.{nonce}.{_mac(secret, ms, nonce, method)}"


class Verifier:
    """Thread-safe; remembers the nonces it accepted until they are too old to pass."""

    def __init__(self, secret: bytes) -> None:
        self._secret = secret
        self._seen: OrderedDict[str, float] = OrderedDict()
        self._lock = threading.Lock()

    def check(self, token: str | None, method: str, now: float | None = None) -> str | None:
        """None when the token is good for this call, else why not."""
        if not token:
            return "no cluster credentials"
        parts = token.split(".")
        if len(parts) != 4 or parts[0] != "v1" or not parts[1].isdigit():
            return "malformed cluster credentials"
        _, ms, nonce, mac = parts
        if not hmac.compare_digest(mac.encode(), _mac(self._secret, ms, nonce, method).encode()):
            return "cluster credentials do not match (wrong cluster secret?)"
        now = time.time() if now is None else now
        if abs(now - int(ms) / 1000) > MAX_SKEW_S:
            return f"cluster credentials expired (clocks more than {MAX_SKEW_S:.0f} s apart?)"
        with self._lock:
            while self._seen and (next(iter(self._seen.values())) < now - 2 * MAX_SKEW_S
                                  or len(self._seen) > _REPLAY_MEMORY):
                self._seen.popitem(last=False)
            if nonce in self._seen:
                return "cluster credentials replayed"
            self._seen[nonce] = now
        return None


def proof(secret: bytes, challenge: bytes, who: str) -> str:
    """What a server answers to prove it holds the secret (KVLink handshake)."""
    return hmac.new(secret, b"tandem-proof:" + challenge + b":" + who.encode(),
                    hashlib.sha256).hexdigest()
