"""LoRA serving over HTTP, one cluster on the tiny model (a prefill and a decode worker
serving adapters a and b, --max-lora-rank 8): the model field selects the adapter (an
unknown one is a 404 naming model), /v1/models lists each adapter under its base, a
prefix cached under a is no hit under b, an adapter loaded while 16 requests stream
serves the next request and none of the 16 fails, an unloaded one is refused, the
admin endpoints take only the admin key and refuse bad input naming the field, the
workers export tandem:lora_requests_info and the request log names the adapter."""
from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.cluster.launch import another_router, cluster
from tests.models.adapters import tiny_adapters

pytest.importorskip("peft", reason="PEFT makes the adapters")

ADMIN = "admin-key-0123456789"
PROMPT = "the adapter decides what comes after these fifty chars"  # 1 token per byte


@pytest.fixture(scope="module")
def c(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-serving")
    paths = tiny_adapters(tiny_model_dir, root, {"a": 8, "b": 4, "late": 8, "wide": 16})
    (root / "admin").write_text(ADMIN)
    worker_args = ["--dtype", "float32", "--kv-blocks", "256", "--max-model-len", "1024",
                   "--lora-modules", f"a={paths['a']}", f"b={paths['b']}", "--max-lora-rank", "8"]
    router_args = ["--local-prefill-threshold", "4", "--max-model-len", "1024",
                   "--admin-key-file", str(root / "admin"), "--log-requests", str(root / "log")]
    with cluster(tiny_model_dir, "tcp", worker_args=worker_args, router_args=router_args) as cl:
        cl.paths, cl.log = paths, root / "log"
        cl.base = httpx.get(cl.url + "/v1/models", timeout=10).json()["data"][0]["id"]
        yield cl


def _complete(c, model: str, prompt: str = PROMPT, max_tokens: int = 8) -> httpx.Response:
    return httpx.post(c.url + "/v1/completions", timeout=120, json={
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})


def _admin(c, path: str, body: dict, key: str | None = ADMIN) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{c.url}/v1/{path}", json=body, headers=headers, timeout=120)


def _cached(r: httpx.Response) -> int:
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_models_lists_each_adapter_under_its_base_and_unknown_is_404(c) -> None:
    data = httpx.get(c.url + "/v1/models", timeout=10).json()["data"]
    assert [(m["id"], m["parent"]) for m in data] == [(c.base, None), ("a", c.base),
                                                       ("b", c.base)]
    assert [m["root"] for m in data[1:]] == [str(c.paths["a"]), str(c.paths["b"])]
    r = _complete(c, "nope")
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    assert r.json()["error"]["message"].startswith("model 'nope' does not exist")


def test_a_prefix_cached_under_one_adapter_is_no_hit_under_another(c) -> None:
    first = _complete(c, "a")
    assert first.json()["model"] == "a" and _cached(first) == 0
    again = _complete(c, "a")
    assert _cached(again) == 48 and again.json()["choices"] == first.json()["choices"]
    assert _cached(_complete(c, "b")) == 0
    assert _cached(_complete(c, c.base)) == 0
    logged = [json.loads(line) for line in c.log.read_text().splitlines()]
    assert [t["lora"] for t in logged[-4:]] == ["a", "a", "b", ""]
    assert {t["path"] for t in logged[-4:]} == {"disaggregated"}
    # the router hashed the second prompt as the worker did under a: it saw its blocks
    assert [t["predicted_cached_tokens"] for t in logged[-4:]] == [0, 48, 0, 0]


def test_loading_an_adapter_while_16_requests_stream(c) -> None:
    started, loaded = threading.Barrier(17), threading.Event()

    def stream(i: int) -> tuple[str, int]:
        """Reads its first chunk, then waits until the load is over to read the rest."""
        body = {"model": ["a", "b", c.base, "a"][i % 4], "prompt": f"{i} {PROMPT}",
                "max_tokens": 128, "temperature": 0, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", c.url + "/v1/completions", json=body, timeout=120) as r:
            lines = r.iter_lines()
            head = [next(ln for ln in lines if ln.startswith("data: {"))]
            started.wait(timeout=120)
            loaded.wait(timeout=120)
            tail = [ln for ln in lines if ln.startswith("data: {")]
        finish = json.loads((head + tail)[-1][6:])["choices"][0]["finish_reason"]
        return finish, r.status_code

    with ThreadPoolExecutor(16) as pool:
        running = [pool.submit(stream, i) for i in range(16)]
        started.wait(timeout=120)  # all 16 are streaming
        try:
            r = _admin(c, "load_lora_adapter", {"lora_name": "late",
                                                "lora_path": str(c.paths["late"])})
            assert r.status_code == 200, r.text
            assert _complete(c, "late").status_code == 200  # the next request: served at once
        finally:
            loaded.set()
        assert [f.result() for f in running] == [("length", 200)] * 16
    ids = [m["id"] for m in httpx.get(c.url + "/v1/models", timeout=10).json()["data"]]
    assert ids == [c.base, "a", "b", "late"]
    assert _admin(c, "unload_lora_adapter", {"lora_name": "late"}).status_code == 200
    r = _complete(c, "late")
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    c.leak_check()


@pytest.mark.parametrize("path, body, key, status, param", [
    ("load_lora_adapter", {"lora_name": "x", "lora_path": "/x"}, None, 401, None),
    ("load_lora_adapter", {"lora_name": "x", "lora_path": "/x"}, "wrong-key-0123", 401, None),
    ("unload_lora_adapter", {"lora_name": "a"}, None, 401, None),
    ("load_lora_adapter", {"lora_name": "x", "lora_path": "/nowhere"}, ADMIN, 400, "lora_path"),
    ("load_lora_adapter", {"lora_name": "x"}, ADMIN, 400, "lora_path"),
    ("load_lora_adapter", {"lora_name": "a", "lora_path": "/x"}, ADMIN, 400, "lora_name"),
    ("unload_lora_adapter", {"lora_name": "nope"}, ADMIN, 404, "lora_name"),
])
def test_admin_endpoints_refuse_bad_input_naming_the_field(c, path, body, key, status,
                                                           param) -> None:
    r = _admin(c, path, body, key)
    assert (r.status_code, r.json()["error"]["param"]) == (status, param), r.text
    assert _complete(c, "a", max_tokens=1).status_code == 200  # everything keeps serving


def test_rank_above_max_lora_rank_is_refused_and_metrics_name_the_adapters(c) -> None:
    r = _admin(c, "load_lora_adapter", {"lora_name": "wide", "lora_path": str(c.paths["wide"])})
    assert (r.status_code, r.json()["error"]["param"]) == (400, "lora_path")
    assert "exceeds --max-lora-rank 8" in r.json()["error"]["message"]
    ids = [m["id"] for m in httpx.get(c.url + "/v1/models", timeout=10).json()["data"]]
    assert "wide" not in ids  # and no worker kept it
    for proc in c.prefill + c.decode:
        assert [a.name for a in c.load(proc).loras] == ["a", "b"]
        info = [ln for ln in c.metrics(proc).splitlines()
                if ln.startswith("tandem:lora_requests_info{")]
        assert len(info) == 1 and 'max_lora="4"' in info[0], info
    c.leak_check()


def test_without_an_admin_key_the_admin_endpoints_are_off(c, tiny_model_dir) -> None:
    with another_router(c, tiny_model_dir) as url:
        r = httpx.post(url + "/v1/load_lora_adapter", timeout=30, headers={
            "authorization": f"Bearer {ADMIN}"}, json={"lora_name": "x", "lora_path": "/x"})
        assert r.status_code == 403 and "--admin-key-file" in r.json()["error"]["message"]
        assert [m["id"] for m in httpx.get(url + "/v1/models", timeout=10).json()["data"]][1:] \
            == ["a", "b"]  # learnt from the workers, not from its own flags
