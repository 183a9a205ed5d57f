"""Chaos: sustained mixed load through `tandem up` while its processes are killed and
its clients misbehave, then an audit of what every client got and what every worker
still holds.

The load: greedy completions (so every answer is checkable against the colocated
engine), streaming and not, mixed priorities, prompts sharing prefixes, plus clients
that hang up at random moments, requests that share one x-request-id and requests
with out-of-range values (which must get a 400 naming the field).

The faults, on a schedule: kill -9 of a prefill worker, of a decode worker, of the
router; `tandem up` restarts each, on its port.

The audit: every request either returned exactly the reference tokens (text) or a
clear error (an OpenAI error object, an SSE error event, or, while the router itself
was down, a refused connection); none outlived its deadline; afterwards every worker
holds no lease, runs and queues nothing, has every block free or cached and its swap
pool empty, and the router's in-flight gauge is 0. The handles a killed router held are
released by nobody: their prefill workers end those leases 5 s after the router's KV
event streams closed (prefill_svc/router_leases.py), so the audit gives them that long
after a router kill; a lease still held at the audit's deadline is a leak, even one the
lease's TTL (--lease-ttl-s, 30 s, the only bound before) would free later.

Used by tests/chaos (bounded, part of `make test`) and bench/chaos.py (a soak that
also samples every process's RSS and reports latency per minute).
"""
from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import httpx

from auth.grpc_auth import sync_channel
from auth.secret import write_secret
from prefill_svc.router_leases import GONE_AFTER_S
from proto import common_pb2, decode_pb2_grpc, prefill_pb2_grpc
from tandem.process import wait_http

DEADLINE_S = 30.0
"""x-request-timeout of every request; the audit checks none took longer (+ grace)."""
GRACE_S = 5.0


@dataclass
class Outcome:
    kind: str
    """ok | error | refused | dropped | invalid"""
    started: float
    ended: float
    detail: str = ""


@dataclass
class Fault:
    at_s: float
    target: str
    """prefill | decode | router"""


@dataclass
class ChaosReport:
    outcomes: list[Outcome] = field(default_factory=list)
    wrong: list[str] = field(default_factory=list)
    """Requests that got HTTP 200 with tokens other than the reference's."""
    late: list[str] = field(default_factory=list)
    unclear: list[str] = field(default_factory=list)
    leaks: list[str] = field(default_factory=list)
    faults_done: list[str] = field(default_factory=list)
    router_down: list[tuple[float, float]] = field(default_factory=list)

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for o in self.outcomes:
            out[o.kind] = out.get(o.kind, 0) + 1
        return out

    @property
    def ok(self) -> bool:
        return not (self.wrong or self.late or self.unclear or self.leaks)

    def summary(self) -> str:
        return (f"requests {len(self.outcomes)} {self.counts()}; faults {self.faults_done}; "
                f"wrong {len(self.wrong)} late {len(self.late)} unclear {len(self.unclear)} "
                f"leaks {self.leaks}")


# -- the cluster ----------------------------------------------------------------------
class UpCluster:
    """`tandem up` as a child process, and its children found through /proc."""

    def __init__(self, model: str, port: int, args: list[str]) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self._tmp = tempfile.TemporaryDirectory(prefix="tandem-chaos-")
        secret_file = Path(self._tmp.name) / "cluster-secret"
        self.secret = write_secret(secret_file)
        cmd = [sys.executable, "-m", "tandem.cli", "--log-level", "WARNING", "up",
               "--model", model, "--port", str(port), "--cluster-secret-file", str(secret_file),
               *args]
        self.proc = subprocess.Popen(cmd, start_new_session=True, stdout=subprocess.DEVNULL)

    def wait_ready(self, timeout_s: float = 240) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"tandem up exited with {self.proc.returncode}")
            try:
                r = httpx.get(self.url + "/ready", timeout=1)
                if r.status_code == 200 and r.json()["prefill"] == len(self.children("prefill")):
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError("tandem up not ready in time")

    def children(self, role: str | None = None) -> list[tuple[int, str, list[str]]]:
        """(pid, role, argv) of tandem up's live children."""
        out = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
                ppid = int(stat.rsplit(")", 1)[1].split()[1])
                argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            except (OSError, ValueError, IndexError):
                continue
            if ppid != self.proc.pid:
                continue
            args = [a.decode() for a in argv if a]
            kind = next((a for a in args if a in ("prefill", "decode", "router")), "")
            if kind and (role is None or kind == role):
                out.append((int(entry), kind, args))
        return sorted(out, key=lambda c: (c[1], _port(c[2]), c[0]))

    def kill(self, role: str) -> int:
        """SIGKILL the first instance of role (by port: always the same one, so the
        others run the whole time)."""
        pid = self.children(role)[0][0]
        os.kill(pid, signal.SIGKILL)
        return pid

    def worker_addrs(self) -> list[tuple[str, str]]:
        """(role, host:port) of every worker, from their command lines."""
        out = []
        for _, role, args in self.children():
            if role in ("prefill", "decode"):
                out.append((role, f"127.0.0.1:{args[args.index('--port') + 1]}"))
        return out

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._tmp.cleanup()

    def rss_mib(self) -> dict[str, tuple[int, float]]:
        """(pid, resident MiB) of tandem up and each child, named role + index by port."""
        out = {"up": (self.proc.pid, _rss(self.proc.pid))}
        seen: dict[str, int] = {}
        for pid, role, _ in self.children():
            i = seen[role] = seen.get(role, -1) + 1
            out[f"{role}{i}"] = (pid, _rss(pid))
        return out


def _port(args: list[str]) -> int:
    return int(args[args.index("--port") + 1]) if "--port" in args else 0


def _rss(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


# -- the load ----------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    prompt: list[int] | str
    max_tokens: int


def make_cases(vocab: int, n_prefixes: int = 3, n_suffixes: int = 4, seed: int = 0) -> list[Case]:
    """Prompts sharing prefixes (token ids, so references are exact), and a few texts."""
    rng = random.Random(seed)
    cases = []
    for p in range(n_prefixes):
        prefix = [rng.randrange(3, vocab) for _ in range(40 + 16 * p)]
        for s in range(n_suffixes):
            suffix = [rng.randrange(3, vocab) for _ in range(rng.randrange(4, 30))]
            cases.append(Case(prefix + suffix, rng.choice((8, 16, 24))))
    cases += [Case("a plain text prompt that the router tokenizes " * 3, 12),
              Case("short", 6)]
    return cases


class Load:
    def __init__(self, url: str, cases: list[Case], refs: dict[int, str], report: ChaosReport,
                 seed: int = 1, api_headers: dict[str, str] | None = None) -> None:
        self.url, self.cases, self.refs, self.report = url, cases, refs, report
        self.rng = random.Random(seed)
        self.headers = api_headers or {}
        self._lock = threading.Lock()
        self.stop = threading.Event()

    def run_client(self, idx: int) -> None:
        rng = random.Random(idx * 7919 + self.rng.random())
        with httpx.Client(timeout=DEADLINE_S + 10) as client:
            while not self.stop.is_set():
                self._one(client, rng)

    def _one(self, client: httpx.Client, rng: random.Random) -> None:
        i = rng.randrange(len(self.cases))
        case = self.cases[i]
        body = {"prompt": case.prompt, "max_tokens": case.max_tokens, "temperature": 0,
                "ignore_eos": True, "priority": rng.choice((0, 1, 2, 3)),
                "stream": rng.random() < 0.5}
        headers = {**self.headers, "x-request-timeout": str(DEADLINE_S)}
        roll = rng.random()
        if roll < 0.08:
            headers["x-request-id"] = f"shared-{rng.randrange(3)}"
        t0 = time.monotonic()
        if roll > 0.95:
            return self._invalid(client, body, headers, rng, t0)
        if 0.85 < roll <= 0.95:
            return self._drop(body, headers, rng, t0)
        try:
            text, err = (self._stream if body["stream"] else self._plain)(client, body, headers)
        except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError) as e:
            self._record(Outcome("refused", t0, time.monotonic(), f"{type(e).__name__}"))
            time.sleep(0.2)  # the router is restarting: don't spin
            return
        except httpx.TimeoutException as e:
            return self._record(Outcome("error", t0, time.monotonic(), f"client timeout {e}"),
                                late=True)
        if err is not None:
            return self._record(Outcome("error", t0, time.monotonic(), err))
        outcome = Outcome("ok", t0, time.monotonic())
        if text != self.refs[i]:
            with self._lock:
                self.report.wrong.append(f"case {i}: got {text!r}, want {self.refs[i]!r}")
        self._record(outcome)

    def _plain(self, client, body, headers) -> tuple[str, str | None]:
        r = client.post(self.url + "/v1/completions", json=body, headers=headers)
        if r.status_code != 200:
            return "", _clear_error(r.status_code, r.text)
        return r.json()["choices"][0]["text"], None

    def _stream(self, client, body, headers) -> tuple[str, str | None]:
        parts = []
        with client.stream("POST", self.url + "/v1/completions", json=body,
                           headers=headers) as r:
            if r.status_code != 200:
                r.read()
                return "", _clear_error(r.status_code, r.text)
            done = False
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    break
                ev = json.loads(data)
                if "error" in ev:
                    return "", f"sse error: {ev['error'].get('message')}"
                parts.append(ev["choices"][0]["text"])
            if not done:
                return "", "stream ended without [DONE]"
        return "".join(parts), None

    def _invalid(self, client, body, headers, rng, t0) -> None:
        (key, value), field_name = rng.choice(((("priority", 2**40), "priority"),
                                               (("stop", ["x"] * 5000), "stop"),
                                               (("temperature", -1), "temperature")))
        try:
            r = client.post(self.url + "/v1/completions",
                            json={**body, key: value, "stream": False}, headers=headers)
        except httpx.HTTPError as e:
            return self._record(Outcome("refused", t0, time.monotonic(), type(e).__name__))
        ok = r.status_code == 400 and r.json().get("error", {}).get("param") == field_name
        if not ok:
            with self._lock:
                self.report.unclear.append(f"invalid {field_name}: HTTP {r.status_code} {r.text[:200]}")
        self._record(Outcome("invalid", t0, time.monotonic()))

    def _drop(self, body, headers, rng, t0) -> None:
        """A client that hangs up at a random moment (mid-prefill, mid-transfer,
        mid-stream), on a raw socket."""
        host, port = self.url.removeprefix("http://").split(":")
        payload = json.dumps(body).encode()
        head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        try:
            with socket.create_connection((host, int(port)), timeout=5) as s:
                s.sendall(f"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: "
                          f"application/json\r\n{head}content-length: {len(payload)}\r\n\r\n"
                          .encode() + payload)
                time.sleep(rng.uniform(0.0, 0.6))
        except OSError:
            pass
        self._record(Outcome("dropped", t0, time.monotonic()))

    def _record(self, o: Outcome, late: bool = False) -> None:
        with self._lock:
            self.report.outcomes.append(o)
            if late or o.ended - o.started > DEADLINE_S + GRACE_S:
                self.report.late.append(f"{o.kind} took {o.ended - o.started:.1f}s {o.detail}")
            if o.kind == "error" and not o.detail:
                self.report.unclear.append("an error without a message")


def _clear_error(status: int, text: str) -> str | None:
    """The error's message when the body is an OpenAI error object, else None-ish."""
    try:
        msg = json.loads(text)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return ""  # an error without a clear body: counted as unclear
    return f"HTTP {status}: {msg}"


# -- the audit ---------------------------------------------------------------------------
AUDIT_WAIT_S = 20.0
"""How long the audit waits for a worker to go idle, at least."""


def audit_deadline(now: float, router_down: list[tuple[float, float]],
                   wait_s: float = AUDIT_WAIT_S) -> float:
    """When the audit may call a held block a leak: ``wait_s`` from now, and never before
    the prefill workers saw a killed router gone. A handle the router held when it died
    is released by nobody: its prefill worker ends the lease once the router's KV event
    stream there has stayed closed for ``GONE_AFTER_S`` (prefill_svc/router_leases.py),
    plus a second for the engine to free the blocks."""
    orphans_freed = max((down + GONE_AFTER_S + 1.0 for down, _ in router_down), default=now)
    return max(now + wait_s, orphans_freed)


def audit_workers(cluster: UpCluster, report: ChaosReport) -> None:
    """Every worker idle with nothing held; the router's in-flight gauge at 0."""
    deadline = audit_deadline(time.monotonic(), report.router_down)
    for role, addr in cluster.worker_addrs():
        stub_cls = prefill_pb2_grpc.PrefillStub if role == "prefill" else decode_pb2_grpc.DecodeStub
        while True:  # asked at least once, however late the deadline
            try:
                with sync_channel(addr, cluster.secret) as ch:
                    load = stub_cls(ch).GetLoad(common_pb2.LoadRequest(), timeout=5)
            except grpc.RpcError:
                load = None
            if (load is not None and _idle(load)) or time.monotonic() >= deadline:
                break
            time.sleep(0.2)
        if load is None or not _idle(load):
            report.leaks.append(f"{role} {addr}: {load}".replace("\n", " "))
    for _ in range(50):
        try:
            metrics = httpx.get(cluster.url + "/metrics", timeout=5).text
            gauge = next(float(x.split()[-1]) for x in metrics.splitlines()
                         if x.startswith("tandem:router_requests_in_flight "))
        except (httpx.HTTPError, StopIteration):
            gauge = -1
        if gauge == 0:
            return
        time.sleep(0.2)
    report.leaks.append(f"router in-flight gauge {gauge}")


def _idle(load) -> bool:
    return (load.active_leases == 0 and load.num_running == 0 and load.num_waiting == 0
            and load.free_blocks == load.total_blocks and load.swap_used_blocks == 0)


def refused_ok(report: ChaosReport) -> None:
    """Refused connections are a clear error only while the router was down."""
    for o in report.outcomes:
        if o.kind != "refused":
            continue
        if not any(a - 1 <= o.started <= b + 1 or a - 1 <= o.ended <= b + 1
                   for a, b in report.router_down):
            report.unclear.append(f"connection refused outside a router restart ({o.detail})")


def run_faults(cluster: UpCluster, faults: list[Fault], t0: float, report: ChaosReport,
               stop: threading.Event) -> None:
    for f in faults:
        while time.monotonic() - t0 < f.at_s:
            if stop.wait(0.05):
                return
        down = time.monotonic()
        cluster.kill(f.target)
        report.faults_done.append(f"{f.target}@{f.at_s:.0f}s")
        if f.target == "router":
            _wait_router_back(cluster)
            report.router_down.append((down, time.monotonic()))


def _wait_router_back(cluster: UpCluster, timeout_s: float = 60) -> None:
    try:
        wait_http(cluster.url + "/ready", timeout_s, "the restarted router")
    except RuntimeError:
        pass  # the audit then finds what went wrong


def run_load(cluster: UpCluster, cases: list[Case], refs: dict[int, str], seconds: float,
             faults: list[Fault], clients: int = 6, seed: int = 1,
             on_tick=None, min_ok: int = 0, max_extra_s: float = 0.0) -> ChaosReport:
    """Drive the load for `seconds` while the faults happen, then on until `min_ok`
    requests were answered right (for at most `max_extra_s` more: a slow, shared box
    gets there later, a stuck cluster never); then audit everything."""
    report = ChaosReport()
    load = Load(cluster.url, cases, refs, report, seed)
    threads = [threading.Thread(target=load.run_client, args=(i,), daemon=True)
               for i in range(clients)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    fault_stop = threading.Event()
    fault_thread = threading.Thread(target=run_faults,
                                    args=(cluster, faults, t0, report, fault_stop), daemon=True)
    fault_thread.start()
    while True:
        time.sleep(1.0)
        elapsed = time.monotonic() - t0
        if on_tick is not None:
            on_tick(elapsed, report)
        if elapsed >= seconds and (report.counts().get("ok", 0) >= min_ok
                                   or elapsed >= seconds + max_extra_s):
            break
    load.stop.set()
    fault_stop.set()
    for t in threads:
        t.join(timeout=DEADLINE_S + 15)
    fault_thread.join(timeout=60)
    cluster.wait_ready()
    refused_ok(report)
    audit_workers(cluster, report)
    return report


def references(model: str, cases: list[Case], dtype: str = "float32") -> dict[int, str]:
    """The colocated engine's greedy text for each case (alone, in this process)."""
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from core.sampling import SamplingParams

    eng = LLMEngine(EngineConfig.from_flat(model=model, dtype=dtype, num_kv_blocks=256, max_model_len=512))
    refs = {}
    for i, case in enumerate(cases):
        params = SamplingParams(max_tokens=case.max_tokens, temperature=0, ignore_eos=True)
        refs[i] = eng.generate([case.prompt], params)[0].text
    eng.leak_check()
    return refs
