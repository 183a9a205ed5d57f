"""HMAC tokens for internal RPCs. A token binds the method it is for, the server it
was made for (the target the client dialed, targets.py), a digest of the request
message, the time it was made and a random nonce:

    v2.<unix ms>.<nonce>.<sha256(message) hex>.<mac>.<target>
    mac = hmac-sha256(secret, "v2\\n" + ms \\n nonce \\n method \\n target \\n digest)

The target goes last because it holds dots; the MAC's fields are joined by newlines,
which none of them can hold (gRPC metadata values cannot), so no two field lists MAC
alike. The verifier accepts each token once, within MAX_SKEW_S of its time, for its
method, for a target the server answers to and for the message whose digest it
carries: a token seen on the wire opens no other call, no other server, no other body."""
from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

MAX_SKEW_S = 60.0
_REPLAY_MEMORY = 200_000
_VERSION = "v2"
SECRET_HINT = "every Tandem process of a cluster needs the same cluster secret " \
              "(--cluster-secret-file)"
NAME_HINT = "start the server with --advertise-host set to the address its clients dial"


def digest(message: bytes) -> str:
    return hashlib.sha256(message).hexdigest()


def _mac(secret: bytes, ms: str, nonce: str, method: str, target: str, body: str) -> str:
    text = "\n".join((_VERSION, ms, nonce, method, target, body))
    return hmac.new(secret, text.encode(), hashlib.sha256).hexdigest()


def mint(secret: bytes, method: str, target: str, message: bytes,
         now: float | None = None) -> str:
    """A token for one call of ``method`` on the server dialed as ``target`` (normalized,
    targets.normalize) carrying ``message`` (the request's serialized bytes)."""
    ms = str(int((time.time() if now is None else now) * 1000))
    nonce, body = secrets.token_hex(12), digest(message)
    mac = _mac(secret, ms, nonce, method, target, body)
    return f"{_VERSION}.{ms}.{nonce}.{body}.{mac}.{target}"


@dataclass(frozen=True)
class Claims:
    """What a token whose MAC matched says about its call."""

    ms: int
    nonce: str
    digest: str
    target: str


class Verifier:
    """Thread-safe; remembers the nonces it accepted until they are too old to pass.
    ``names``: the targets this server answers to (targets.server_names)."""

    def __init__(self, secret: bytes, names: frozenset[str] = frozenset()) -> None:
        self._secret = secret
        self.names = names
        self._seen: OrderedDict[str, float] = OrderedDict()
        self._lock = threading.Lock()

    def check(self, token: str | None, method: str, message: bytes,
              now: float | None = None) -> str | None:
        """None when the token is good for this call (and it is spent), else why not."""
        claims, why = self.open(token, method, now)
        return why if claims is None else self.admit(claims, message, now)

    def open(self, token: str | None, method: str, now: float | None = None
             ) -> tuple[Claims | None, str | None]:
        """Everything but the message: form, MAC, target, time, replay. Cheap, so a
        call is refused on its metadata before its body is hashed or parsed."""
        if not token:
            return None, f"no cluster credentials; {SECRET_HINT}"
        parts = token.split(".", 5)
        if len(parts) != 6 or parts[0] != _VERSION or not parts[1].isdigit():
            return None, f"malformed cluster credentials; {SECRET_HINT}"
        _, ms, nonce, body, mac, target = parts
        if not hmac.compare_digest(mac.encode(), _mac(self._secret, ms, nonce, method,
                                                      target, body).encode()):
            return None, f"cluster credentials do not match (wrong cluster secret?); {SECRET_HINT}"
        if target not in self.names:
            return None, (f"cluster credentials were made for server {target}, but this "
                          f"server answers to {', '.join(sorted(self.names)) or 'no name'}; "
                          f"{NAME_HINT}")
        now = time.time() if now is None else now
        if abs(now - int(ms) / 1000) > MAX_SKEW_S:
            return None, f"cluster credentials expired (clocks more than {MAX_SKEW_S:.0f} s apart?)"
        with self._lock:
            if nonce in self._seen:
                return None, "cluster credentials replayed"
        return Claims(int(ms), nonce, body, target), None

    def admit(self, claims: Claims, message: bytes, now: float | None = None) -> str | None:
        """The message's digest must be the one the token carries; then the nonce is
        spent (only now: a replay with another body does not burn the real call's)."""
        if not hmac.compare_digest(digest(message).encode(), claims.digest.encode()):
            return "cluster credentials were made for another request message (sha256 differs)"
        now = time.time() if now is None else now
        with self._lock:
            while self._seen and (next(iter(self._seen.values())) < now - 2 * MAX_SKEW_S
                                  or len(self._seen) > _REPLAY_MEMORY):
                self._seen.popitem(last=False)
            if claims.nonce in self._seen:
                return "cluster credentials replayed"
            self._seen[claims.nonce] = now
        return None


def proof(secret: bytes, challenge: bytes, who: str) -> str:
    """What a server answers to prove it holds the secret (KVLink handshake)."""
    return hmac.new(secret, b"tandem-proof:" + challenge + b":" + who.encode(),
                    hashlib.sha256).hexdigest()
