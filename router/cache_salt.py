"""Which prefix cache a request's KV belongs to: its cache salt, derived here at the
edge and carried to every worker it touches (PrefillRequest and GenerateRequest
``cache_salt``), where it seeds the prompt's block hashes
(core/kv/block_hash.py). The router hashes prompts for placement under the
same salt, so routing stays prefix-aware within a tenant.

- With API keys, every request is salted by its key's tenant (ApiKey.cache_tenant:
  the key's cache_group, else its name): a tenant cannot learn from cached_tokens or
  time to first token whether another tenant sent a prompt.
- A client's ``cache_salt`` (vLLM's request field) splits its tenant's cache further.
  It is hashed together with the tenant, so it cannot name another tenant's cache.
- An open router (no keys) leaves a request without cache_salt unsalted: one shared
  cache, whose hashes are those Tandem always computed.

What travels is a sha256 digest: workers, KV events, logs and metrics never see a
key's name, a group or a client's cache_salt in clear.
"""
from __future__ import annotations

import hashlib

from auth.keys import ApiKey

DOMAIN = b"tandem-cache-salt/v1"


def request_salt(key: ApiKey | None, cache_salt: str | None) -> bytes:
    """The salt of a request sent with ``key`` (None: an open router) and the client's
    cache_salt (None: not given); b"" only when neither is there."""
    if key is None and cache_salt is None:
        return b""
    h = hashlib.sha256(DOMAIN)
    for part in (key.cache_tenant if key is not None else "", cache_salt or ""):
        raw = part.encode()
        h.update(len(raw).to_bytes(4, "big") + raw)  # length-prefixed: no two pairs run together
    return h.digest()
