"""The cache salt the router derives per request (router/cache_salt.py): one per API
key's tenant, shared by a cache_group, split by the client's cache_salt without ever
reaching another tenant's, and none at all for an unsalted request on an open router."""
from __future__ import annotations

from auth.keys import ApiKey, KeyRing
from router.cache_salt import request_salt


def test_each_tenant_has_its_own_salt_and_a_group_shares_one(tmp_path) -> None:
    f = tmp_path / "keys.yaml"
    f.write_text("keys:\n"
                 "  - {key: sk-tenant-a-1, name: a}\n"
                 "  - {key: sk-tenant-a-2, name: a}\n"  # a rotated key of tenant a
                 "  - {key: sk-tenant-b-1, name: b}\n"
                 "  - {key: sk-tenant-c-1, name: c, cache_group: g}\n"
                 "  - {key: sk-tenant-d-1, name: d, cache_group: g}\n"
                 "  - {key: sk-tenant-e-1, name: g}\n")  # a key named like the group
    ring = KeyRing(str(f))
    a1, a2, b, c, d, e = (request_salt(ring.lookup(k.encode()), None) for k in (
        "sk-tenant-a-1", "sk-tenant-a-2", "sk-tenant-b-1", "sk-tenant-c-1", "sk-tenant-d-1",
        "sk-tenant-e-1"))
    assert a1 == a2 and c == d
    assert len({a1, b, c, e}) == 4 and len(a1) == 32


def test_a_clients_cache_salt_splits_its_tenants_cache_and_reaches_no_other() -> None:
    a, b = ApiKey(b"sk-tenant-a-1", "a"), ApiKey(b"sk-tenant-b-1", "b")
    assert request_salt(None, None) == b""  # an open router's shared cache, unsalted
    seen = {request_salt(k, s) for k in (a, b, None) for s in (None, "x", "y", "a", "key:a")}
    assert len(seen) == 15  # every pair apart: no salt names another tenant's cache
    # the tenant and the client's salt cannot run together into another pair
    assert request_salt(ApiKey(b"k" * 8, "ab"), "c") != request_salt(ApiKey(b"k" * 8, "a"), "bc")
