"""Tenants keep their own prefix cache, through the HTTP router as clients see it
(usage.prompt_tokens_details.cached_tokens): one API key's prompt is no hit for
another key, its own repeat is; keys of one cache_group share; cache_salt splits a
key's cache, and on an open router it separates requests too. Real worker and router
processes on the tiny model, a keyed router and an open one over the same workers."""
from __future__ import annotations

import httpx
import pytest

from tests.cluster.launch import another_router, cluster

TINY = ["--dtype", "float32", "--kv-blocks", "256"]
KEYS = ("keys:\n"
        "  - {key: sk-tenant-a-0001, name: team-a}\n"
        "  - {key: sk-tenant-b-0002, name: team-b}\n"
        "  - {key: sk-tenant-c-0003, name: team-c, cache_group: shared}\n"
        "  - {key: sk-tenant-d-0004, name: team-d, cache_group: shared}\n")


@pytest.fixture(scope="module")
def routers(tiny_model_dir, tmp_path_factory):
    """(keyed router URL, open router URL, the cluster, the keyed router's request log)."""
    d = tmp_path_factory.mktemp("tenants")
    (d / "keys.yaml").write_text(KEYS)
    log = d / "requests.jsonl"
    with cluster(tiny_model_dir, "tcp", worker_args=TINY,
                 router_args=["--local-prefill-threshold", "8", "--log-requests", str(log),
                              f"--api-keys-file={d / 'keys.yaml'}"]) as c:
        with another_router(c, tiny_model_dir, ["--local-prefill-threshold", "8"]) as open_url:
            yield c.url, open_url, c, log


def _prompt(seed: int) -> list[int]:
    return [(seed * 31 + i * 7) % 300 + 3 for i in range(50)]  # 3 full blocks + 2 tokens


def cached(url: str, key: str | None, prompt: list[int], **body) -> int:
    """The prompt tokens the cluster served from its prefix cache for this request."""
    headers = {"authorization": f"Bearer {key}"} if key else {}
    r = httpx.post(url + "/v1/completions", headers=headers, timeout=60,
                   json={"prompt": prompt, "max_tokens": 2, "ignore_eos": True, **body})
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_another_key_does_not_see_a_keys_cached_prompt(routers) -> None:
    url, _, c, _ = routers
    p = _prompt(1)
    assert cached(url, "sk-tenant-a-0001", p) == 0
    assert cached(url, "sk-tenant-b-0002", p) == 0  # before: 48, A's blocks
    assert cached(url, "sk-tenant-a-0001", p) >= 32  # A's own repeat hits
    assert cached(url, "sk-tenant-b-0002", p) >= 32  # and so does B's, in B's cache
    c.leak_check()


def test_keys_of_one_cache_group_share_their_cache(routers) -> None:
    url, _, c, _ = routers
    p = _prompt(2)
    assert cached(url, "sk-tenant-c-0003", p) == 0
    assert cached(url, "sk-tenant-d-0004", p) >= 32  # same group: C's blocks
    assert cached(url, "sk-tenant-a-0001", p) == 0  # outside the group: nothing
    c.leak_check()


def test_cache_salt_splits_a_keys_cache_and_cannot_reach_another_keys(routers) -> None:
    url, _, c, log = routers
    p = _prompt(3)
    assert cached(url, "sk-tenant-a-0001", p, cache_salt="user-1") == 0
    assert cached(url, "sk-tenant-a-0001", p) == 0  # A without the salt: apart
    assert cached(url, "sk-tenant-b-0002", p, cache_salt="user-1") == 0  # B, same salt
    assert cached(url, "sk-tenant-a-0001", p, cache_salt="user-1") >= 32
    assert "user-1" not in log.read_text()  # the salt is never logged in clear
    c.leak_check()


def test_cache_salt_separates_requests_on_an_open_router(routers) -> None:
    _, url, c, _ = routers
    p = _prompt(4)
    assert cached(url, None, p) == 0
    assert cached(url, None, p) >= 32  # unsalted requests share one cache, as before
    assert cached(url, None, p, cache_salt="s1") == 0
    assert cached(url, None, p, cache_salt="s2") == 0
    assert cached(url, None, p, cache_salt="s1") >= 32
    c.leak_check()


@pytest.mark.parametrize("salt", [123, "", "x" * 257, ["a"]])
def test_a_malformed_cache_salt_is_a_400_naming_it(routers, salt) -> None:
    url, open_url, c, _ = routers
    for u, key in ((url, "sk-tenant-a-0001"), (open_url, None)):
        r = httpx.post(u + "/v1/chat/completions", timeout=60,
                       headers={"authorization": f"Bearer {key}"} if key else {},
                       json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                             "cache_salt": salt})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "cache_salt"
