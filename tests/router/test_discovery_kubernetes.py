"""KubernetesDiscovery against a recorded-response API server (no real cluster).

``FakeApiServer`` listens on 127.0.0.1 and answers the EndpointSlice LIST with
recorded bodies from ``data/endpointslices/`` and WATCH (``watch=true``) with a
chunked stream of the events a test pushes, as the API server does. The client
reaches it through a generated kubeconfig with no auth.
"""
from __future__ import annotations

import asyncio
import json
import queue
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, AsyncIterator
from urllib.parse import parse_qs, urlsplit

import pytest

pytest.importorskip("kubernetes")

from router.discovery import kubernetes as k8s  # noqa: E402
from router.discovery.base import WorkerEndpoint  # noqa: E402

DATA = Path(__file__).parent / "data" / "endpointslices"
NAMESPACE = "tandem"
SELECTORS = {"prefill": "app.kubernetes.io/component=prefill",
             "decode": "app.kubernetes.io/component=decode"}
PATH = f"/apis/discovery.k8s.io/v1/namespaces/{NAMESPACE}/endpointslices"
END = object()  # pushed to end a watch stream normally


def recorded(name: str) -> dict:
    return json.loads((DATA / f"{name}.json").read_text())


class _Handler(BaseHTTPRequestHandler):
    """Serves the FakeApiServer that owns its HTTP server (``self.server.fake``)."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        fake = self.server.fake  # type: ignore[attr-defined]
        url = urlsplit(self.path)
        query = parse_qs(url.query)
        fake.requests.append(query)
        role = {v: k for k, v in SELECTORS.items()}.get(query.get("labelSelector", [""])[0])
        if url.path != PATH or role is None:
            return self._json(404, {"kind": "Status", "code": 404, "reason": "NotFound"})
        if query.get("watch", [""])[0].lower() in ("true", "1"):
            return self._stream(fake.events[role], fake.closing)
        if fake.fail_lists[role] > 0:
            fake.fail_lists[role] -= 1
            return self._json(500, {"kind": "Status", "code": 500,
                                    "reason": "InternalError", "message": "etcd timeout"})
        self._json(200, fake.lists[role])

    def _json(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)
        self.close_connection = True

    def _stream(self, events: queue.Queue, closing: threading.Event) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        try:
            while not closing.is_set():
                try:
                    event = events.get(timeout=0.05)
                except queue.Empty:
                    continue
                if event is END:
                    break
                line = json.dumps(event).encode() + b"\n"
                self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
                if event["type"] == "ERROR":  # the API server ends the watch after one
                    break
            self.wfile.write(b"0\r\n\r\n")
        except OSError:  # the client hung up
            pass


class _Server(ThreadingHTTPServer):
    daemon_threads = False  # server_close joins every handler


class FakeApiServer:
    """Recorded LIST bodies per role; WATCH streams what ``push`` queues."""

    def __init__(self) -> None:
        self.lists = {"prefill": recorded("list_prefill"), "decode": recorded("list_decode")}
        self.fail_lists = {"prefill": 0, "decode": 0}  # answer this many LISTs with 500
        self.events: dict[str, queue.Queue] = {r: queue.Queue() for r in SELECTORS}
        self.requests: list[dict[str, list[str]]] = []  # query of each request, in order
        self.closing = threading.Event()
        self.httpd = _Server(("127.0.0.1", 0), _Handler)
        self.httpd.fake = self  # type: ignore[attr-defined]
        self.port = self.httpd.server_address[1]
        self._thread = threading.Thread(target=self.httpd.serve_forever,
                                        args=(0.05,), daemon=True)
        self._thread.start()

    def push(self, role: str, name: str) -> None:
        self.events[role].put(recorded(name))

    def queries(self, role: str, watch: bool) -> list[dict[str, list[str]]]:
        return [q for q in self.requests if q.get("labelSelector") == [SELECTORS[role]]
                and (q.get("watch", [""])[0].lower() in ("true", "1")) == watch]

    def close(self) -> None:
        self.closing.set()
        self.httpd.shutdown()
        self.httpd.server_close()
        self._thread.join(2)


@pytest.fixture
def api(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeApiServer:
    server = FakeApiServer()
    kubeconfig = {
        "apiVersion": "v1", "kind": "Config", "current-context": "fake",
        "clusters": [{"name": "fake", "cluster": {"server": f"http://127.0.0.1:{server.port}"}}],
        "users": [{"name": "anonymous", "user": {}}],
        "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "anonymous"}}],
    }
    path = tmp_path / "kubeconfig"
    path.write_text(json.dumps(kubeconfig))  # JSON is YAML
    monkeypatch.setenv("KUBECONFIG", str(path))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setattr(k8s, "NAMESPACE_FILE", tmp_path / "no-such-namespace-file")
    yield server
    server.close()


def discovery(**kwargs: Any) -> k8s.KubernetesDiscovery:
    return k8s.KubernetesDiscovery(NAMESPACE, SELECTORS, "grpc", backoff_s=(0.05, 0.2),
                                   initial_wait_s=5.0, **kwargs)


def by_role(endpoints: frozenset[WorkerEndpoint]) -> dict[str, set[str]]:
    return {r: {e.address for e in endpoints if e.role == r} for r in SELECTORS}


async def following(disc: k8s.KubernetesDiscovery, body) -> None:
    """Run ``body(next_set)`` over ``disc.watch()``, then close it and check that its
    watcher threads are gone (the leak check)."""
    gen: AsyncIterator[frozenset[WorkerEndpoint]] = disc.watch()

    async def next_set() -> dict[str, set[str]]:
        return by_role(await asyncio.wait_for(gen.__anext__(), timeout=5))

    try:
        await body(next_set)
    finally:
        await gen.aclose()
    assert not [t for t in threading.enumerate() if t.name.startswith("k8s-discovery-")]


def wait_for(predicate, timeout_s: float = 3.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def test_initial_list_excludes_non_ready_and_sends_selectors(api: FakeApiServer) -> None:
    async def body(next_set) -> None:
        assert await next_set() == {"prefill": {"10.244.1.15:9000"},  # 10.244.2.9 is not ready
                                    "decode": {"10.244.1.21:9000"}}
        await asyncio.to_thread(wait_for,
                                lambda: all(api.queries(r, watch=True) for r in SELECTORS))

    asyncio.run(following(discovery(), body))
    for role in SELECTORS:
        assert len(api.queries(role, watch=False)) == 1  # the selector reached the server
        watch = api.queries(role, watch=True)[0]
        assert watch["resourceVersion"] == ["48213"]  # watched from the list's version
        assert watch["allowWatchBookmarks"] == ["true"]


def test_watch_events_add_modify_delete(api: FakeApiServer) -> None:
    async def body(next_set) -> None:
        assert (await next_set())["decode"] == {"10.244.1.21:9000"}
        api.push("decode", "event_decode_added")
        assert (await next_set())["decode"] == {"10.244.1.21:9000", "10.244.3.7:9000"}
        api.push("decode", "event_decode_added")  # same set again: not yielded (dedupe)
        api.push("decode", "event_decode_modified_not_ready")  # 10.244.1.21 terminating
        assert await next_set() == {"prefill": {"10.244.1.15:9000"},
                                    "decode": {"10.244.3.7:9000"}}
        api.push("decode", "event_decode_deleted")
        assert (await next_set())["decode"] == set()

    asyncio.run(following(discovery(), body))


def test_watch_end_reopens_without_relist(api: FakeApiServer) -> None:
    async def body(next_set) -> None:
        await next_set()
        api.push("decode", "event_decode_added")
        await next_set()
        api.events["decode"].put(END)  # server-side timeout ends the stream
        api.push("decode", "event_decode_deleted")
        assert (await next_set())["decode"] == {"10.244.1.21:9000"}

    asyncio.run(following(discovery(), body))
    assert len(api.queries("decode", watch=False)) == 1
    assert [q["resourceVersion"] for q in api.queries("decode", watch=True)][:2] == \
        [["48213"], ["48301"]]  # reopened from the last event's version


def test_410_gone_relists_and_converges(api: FakeApiServer) -> None:
    async def body(next_set) -> None:
        assert (await next_set())["decode"] == {"10.244.1.21:9000"}
        api.lists["decode"] = recorded("list_decode_relist")
        api.push("decode", "event_gone_410")
        assert await next_set() == {"prefill": {"10.244.1.15:9000"},
                                    "decode": {"10.244.1.21:9000", "10.244.4.3:9000"}}
        await asyncio.to_thread(wait_for, lambda: len(api.queries("decode", watch=True)) == 2)

    asyncio.run(following(discovery(), body))
    assert len(api.queries("decode", watch=False)) == 2
    assert len(api.queries("prefill", watch=False)) == 1
    assert api.queries("decode", watch=True)[1]["resourceVersion"] == ["50912"]


def test_list_errors_are_retried_and_logged(api: FakeApiServer,
                                             caplog: pytest.LogCaptureFixture) -> None:
    api.fail_lists["decode"] = 2

    async def body(next_set) -> None:
        assert await next_set() == {"prefill": {"10.244.1.15:9000"},
                                    "decode": {"10.244.1.21:9000"}}

    with caplog.at_level("WARNING", logger=k8s.__name__):
        asyncio.run(following(discovery(), body))
    assert len(api.queries("decode", watch=False)) == 3
    assert sum("HTTP 500" in r.getMessage() for r in caplog.records) == 2


def test_cancelling_the_consumer_stops_the_threads(api: FakeApiServer) -> None:
    """The router cancels the task iterating watch(); the blocked watch reads must end."""
    async def main() -> None:
        first = asyncio.Event()

        async def follow() -> None:
            async for _ in discovery().watch():
                first.set()

        task = asyncio.create_task(follow())
        await asyncio.wait_for(first.wait(), timeout=5)
        await asyncio.to_thread(wait_for,
                                lambda: all(api.queries(r, watch=True) for r in SELECTORS))
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert not [t for t in threading.enumerate() if t.name.startswith("k8s-discovery-")]

    asyncio.run(main())


def test_endpoint_rule_ipv6_and_port_name() -> None:
    v6 = recorded("slice_ipv6")
    # conditions {serving: true} alone: ready absent means ready.
    assert k8s.endpoint_addresses(v6, "grpc") == {"[fd00:10:244::1c]:9000",
                                                  "[fd00:10:244::2a]:9000"}
    assert k8s.endpoint_addresses(v6, "metrics") == {"[fd00:10:244::1c]:9100",
                                                     "[fd00:10:244::2a]:9100"}
    assert k8s.endpoint_addresses(v6, "http") == frozenset()  # no such port: nothing
    draining = {"addressType": "IPv4", "ports": [{"name": "grpc", "port": 9000}],
                "endpoints": [{"addresses": ["10.0.0.1"],
                               "conditions": {"serving": True, "terminating": True}},
                              {"addresses": ["10.0.0.2"], "conditions": {"ready": False}},
                              {"addresses": ["10.0.0.3"]}]}
    assert k8s.endpoint_addresses(draining, "grpc") == {"10.0.0.3:9000"}


def test_namespace_defaults(api: FakeApiServer, tmp_path: Path,
                            monkeypatch: pytest.MonkeyPatch) -> None:
    assert k8s.KubernetesDiscovery(None, SELECTORS, "grpc").namespace == "default"
    pod_ns = tmp_path / "namespace"
    pod_ns.write_text("serving\n")
    monkeypatch.setattr(k8s, "NAMESPACE_FILE", pod_ns)
    assert k8s.KubernetesDiscovery(None, SELECTORS, "grpc").namespace == "serving"
    assert k8s.KubernetesDiscovery("other", SELECTORS, "grpc").namespace == "other"


def test_bad_config_is_a_value_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="kubeconfig"):
        k8s.KubernetesDiscovery(NAMESPACE, SELECTORS, "grpc")
    with pytest.raises(ValueError, match="selectors"):
        k8s.KubernetesDiscovery(NAMESPACE, {"prefil": "x=y"}, "grpc")
