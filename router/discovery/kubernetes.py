"""Kubernetes discovery: watch the EndpointSlices of the prefill and decode Services.

For each role one daemon thread runs the blocking ``kubernetes`` client:
LIST ``discovery.k8s.io/v1`` EndpointSlices matching the role's label selector,
then WATCH from the list's resourceVersion; a watch that ends (server timeout) is
reopened from the last resourceVersion seen; a 410 Gone or any error re-lists,
with exponential backoff after errors (each one logged). A thread hands its
role's whole address set to the event loop with ``call_soon_threadsafe``; the
async side merges the roles and yields the full set when it changes.

Which endpoints count (the rule): an endpoint is a worker iff its
``conditions.ready`` is not false (absent means ready, as the API says) and its
``conditions.terminating`` is not true. A terminating pod can still report
``serving: true`` while it drains; the router keeps long-lived streams to its
workers, so it sends nothing new to a draining pod. (Don't set
``publishNotReadyAddresses`` on the worker Services: that makes every endpoint
report ready.) The address is ``addresses[0]`` with the slice's port named
``port_name``; a slice without that port contributes nothing. IPv6 addresses are
bracketed: ``[fd00::5]:9000``.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import threading
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Mapping

from router.discovery.base import Discovery, Role, WorkerEndpoint

log = logging.getLogger(__name__)

NAMESPACE_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
ROLES: tuple[Role, ...] = ("prefill", "decode")


class _Gone(Exception):
    """The watch's resourceVersion is too old (HTTP 410): re-list."""


def endpoint_addresses(slice_: Mapping[str, Any], port_name: str) -> frozenset[str]:
    """The ``host:port`` of each usable endpoint of one EndpointSlice (JSON as the
    API server sends it), by the rule in the module docstring."""
    port = next((p.get("port") for p in slice_.get("ports") or ()
                 if p.get("name") == port_name), None)
    if port is None:
        return frozenset()
    ipv6 = slice_.get("addressType") == "IPv6"
    out = set()
    for ep in slice_.get("endpoints") or ():
        cond = ep.get("conditions") or {}
        if cond.get("ready") is False or cond.get("terminating") is True:
            continue
        addrs = ep.get("addresses") or ()
        if addrs:
            host = addrs[0]
            out.add(f"[{host}]:{port}" if ipv6 or ":" in host else f"{host}:{port}")
    return frozenset(out)


def default_namespace() -> str:
    """The pod's own namespace when running in one, else ``default``."""
    try:
        return NAMESPACE_FILE.read_text().strip() or "default"
    except OSError:
        return "default"


def _api_client() -> Any:
    """An ApiClient from the in-cluster service account when in a pod, else from
    the kubeconfig (``KUBECONFIG``, else ~/.kube/config)."""
    from kubernetes import client, config

    cfg = client.Configuration()
    in_pod = bool(os.environ.get("KUBERNETES_SERVICE_HOST"))
    # KUBE_CONFIG_DEFAULT_LOCATION is fixed at import time; read KUBECONFIG now.
    path = os.environ.get("KUBECONFIG") or "~/.kube/config"
    try:
        if in_pod:
            config.load_incluster_config(client_configuration=cfg)
        else:
            config.load_kube_config(config_file=path, client_configuration=cfg)
    except (config.ConfigException, OSError) as e:
        where = "in-cluster service account" if in_pod else f"kubeconfig {path}"
        raise ValueError(f"--discovery kubernetes: cannot load the {where}: {e}") from e
    return client.ApiClient(cfg)


class _RoleWatcher(threading.Thread):
    """List-then-watch loop of one role's EndpointSlices, on its own thread."""

    def __init__(self, role: Role, api: Any, namespace: str, selector: str, port_name: str,
                 post: Callable[[Role, frozenset[str]], None], watch_timeout_s: int,
                 backoff_s: tuple[float, float]) -> None:
        super().__init__(name=f"k8s-discovery-{role}", daemon=True)
        self.role, self.api, self.namespace, self.selector = role, api, namespace, selector
        self.port_name, self.post = port_name, post
        self.watch_timeout_s, self.backoff_s = watch_timeout_s, backoff_s
        self.slices: dict[str, frozenset[str]] = {}  # slice name -> its addresses
        self.posted: frozenset[str] | None = None
        self._halt = threading.Event()
        self._lock = threading.Lock()  # guards _resp against stop()
        self._resp: Any = None

    def stop(self) -> None:
        """Ask the thread to end and unblock a read in progress (callable from any thread)."""
        self._halt.set()
        with self._lock:
            if self._resp is not None:
                # urllib3 >= 2.3 shutdown() wakes a thread blocked in recv; close() may not.
                getattr(self._resp, "shutdown", self._resp.close)()

    def run(self) -> None:
        delay = self.backoff_s[0]
        while not self._halt.is_set():
            try:
                rv = self._list()
                delay = self.backoff_s[0]
                while not self._halt.is_set():
                    rv = self._watch(rv)
            except _Gone:
                log.info("kubernetes discovery (%s): watch expired (410 Gone); re-listing",
                         self.role)
            except Exception as e:  # noqa: BLE001 - every failure is retried, never raised
                if self._halt.is_set():
                    return
                log.warning("kubernetes discovery (%s, namespace %s, selector %s): %s; "
                            "re-listing in %.1f s", self.role, self.namespace, self.selector,
                            _describe(e), delay)
            # A 410 right after a list waits the first delay too: no tight re-list loop.
            self._halt.wait(delay * random.uniform(0.8, 1.2))
            delay = min(delay * 2, self.backoff_s[1])

    def _request(self, **kwargs: Any) -> Any:
        """One raw (undeserialized) LIST or WATCH request, registered for stop()."""
        resp = self.api.list_namespaced_endpoint_slice(
            self.namespace, label_selector=self.selector, _preload_content=False, **kwargs)
        with self._lock:
            if self._halt.is_set():
                resp.close()
                raise InterruptedError("stopped")
            self._resp = resp
        return resp

    def _release(self, resp: Any) -> None:
        with self._lock:
            self._resp = None
        resp.close()
        resp.release_conn()

    def _list(self) -> str:
        resp = self._request(_request_timeout=(5, 30))
        try:
            body = json.loads(resp.data)
        finally:
            self._release(resp)
        self.slices = {s["metadata"]["name"]: endpoint_addresses(s, self.port_name)
                       for s in body.get("items") or ()}
        self._publish()
        return body["metadata"]["resourceVersion"]

    def _watch(self, rv: str) -> str:
        """Follow one watch request from ``rv``; return the last resourceVersion seen
        when the server ends it. Raises _Gone on 410."""
        from kubernetes.client.rest import ApiException
        from kubernetes.watch.watch import iter_resp_lines

        try:
            resp = self._request(watch=True, resource_version=rv, allow_watch_bookmarks=True,
                                 timeout_seconds=self.watch_timeout_s,
                                 _request_timeout=(5, self.watch_timeout_s + 15))
        except ApiException as e:
            if e.status == 410:
                raise _Gone from e
            raise
        try:
            for line in iter_resp_lines(resp):
                if self._halt.is_set():
                    break
                if line:
                    rv = self._apply(json.loads(line), rv)
        finally:
            self._release(resp)
        return rv

    def _apply(self, event: Mapping[str, Any], rv: str) -> str:
        kind, obj = event.get("type"), event.get("object") or {}
        if kind == "ERROR":
            if obj.get("code") == 410:
                raise _Gone
            raise RuntimeError(f"watch error {obj.get('code')} {obj.get('reason')}: "
                               f"{obj.get('message')}")
        meta = obj.get("metadata") or {}
        if kind in ("ADDED", "MODIFIED"):
            self.slices[meta["name"]] = endpoint_addresses(obj, self.port_name)
        elif kind == "DELETED":
            self.slices.pop(meta["name"], None)
        if kind != "BOOKMARK":
            self._publish()
        return meta.get("resourceVersion") or rv

    def _publish(self) -> None:
        merged = frozenset().union(*self.slices.values())
        if merged != self.posted:
            self.posted = merged
            self.post(self.role, merged)


def _describe(e: BaseException) -> str:
    status = getattr(e, "status", None)
    if status in (401, 403):
        return (f"HTTP {status} {getattr(e, 'reason', '')}: the router's service account "
                "needs get/list/watch on endpointslices.discovery.k8s.io")
    if status:
        return f"HTTP {status} {getattr(e, 'reason', '')}"
    return f"{type(e).__name__}: {e}"


class KubernetesDiscovery(Discovery):
    """Workers are the ready endpoints of the EndpointSlices each role's label
    selector matches, in one namespace. The constructor loads the client config
    (so a missing kubeconfig is a ValueError before serving) but starts nothing;
    each ``watch()`` runs its own watcher threads and stops them when closed."""

    def __init__(self, namespace: str | None, selectors: Mapping[str, str],
                 port_name: str = "grpc", *, watch_timeout_s: int = 240,
                 backoff_s: tuple[float, float] = (0.5, 30.0),
                 initial_wait_s: float = 5.0) -> None:
        unknown = set(selectors) - set(ROLES)
        if unknown or not selectors:
            raise ValueError(f"kubernetes discovery: selectors must name roles of {ROLES}, "
                             f"got {sorted(selectors)}")
        self.namespace = namespace or default_namespace()
        self.selectors = dict(selectors)
        self.port_name = port_name
        self.watch_timeout_s = watch_timeout_s
        """Server-side timeout of one watch request; it is then reopened."""
        self.backoff_s = backoff_s
        """First and largest delay before retrying after an error (doubling, jittered)."""
        self.initial_wait_s = initial_wait_s
        """The first set waits for every role's first list, at most this long."""
        self._api = _api_client()

    async def watch(self) -> AsyncIterator[frozenset[WorkerEndpoint]]:
        from kubernetes import client

        loop = asyncio.get_running_loop()
        updates: asyncio.Queue[tuple[Role, frozenset[str]]] = asyncio.Queue()

        def post(role: Role, addrs: frozenset[str]) -> None:
            try:
                loop.call_soon_threadsafe(updates.put_nowait, (role, addrs))
            except RuntimeError:  # loop closed: the consumer is gone
                pass

        api = client.DiscoveryV1Api(self._api)
        watchers = [_RoleWatcher(role, api, self.namespace, sel, self.port_name, post,
                                 self.watch_timeout_s, self.backoff_s)
                    for role, sel in self.selectors.items()]
        current: dict[Role, frozenset[str]] = {}
        last: frozenset[WorkerEndpoint] | None = None
        try:
            for w in watchers:
                w.start()
            deadline = loop.time() + self.initial_wait_s
            while len(current) < len(watchers):  # first set: every role listed, or timeout
                try:
                    role, addrs = await asyncio.wait_for(updates.get(), deadline - loop.time())
                except asyncio.TimeoutError:
                    log.warning("kubernetes discovery: no list yet for %s after %.0f s; "
                                "starting without", sorted(set(self.selectors) - set(current)),
                                self.initial_wait_s)
                    break
                current[role] = addrs
            while True:
                merged = frozenset(WorkerEndpoint(role, a)
                                   for role, addrs in current.items() for a in addrs)
                if merged != last:
                    last = merged
                    yield merged
                role, addrs = await updates.get()
                current[role] = addrs
        finally:
            for w in watchers:
                w.stop()
            await asyncio.to_thread(_join, watchers, 2.0)


def _join(threads: list[threading.Thread], timeout_s: float) -> None:
    for t in threads:
        if t.is_alive():
            t.join(timeout_s)
