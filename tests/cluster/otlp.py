"""An OTLP/HTTP traces endpoint on 127.0.0.1 for tests: the services export to it as
to a collector (tracing/provider.py), and it keeps every span it receives, decoded
from the ExportTraceServiceRequest of opentelemetry-proto."""
from __future__ import annotations

import gzip
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest, ExportTraceServiceResponse)
from opentelemetry.proto.trace.v1.trace_pb2 import Span as SpanProto

SERVER, CLIENT, INTERNAL = (SpanProto.SPAN_KIND_SERVER, SpanProto.SPAN_KIND_CLIENT,
                            SpanProto.SPAN_KIND_INTERNAL)


@dataclass
class Span:
    service: str
    name: str
    kind: int
    trace_id: str
    span_id: str
    parent_id: str
    attributes: dict
    events: list[tuple[str, dict]] = field(default_factory=list)
    error: bool = False
    start_ns: int = 0
    end_ns: int = 0


def _value(v):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return tuple(_value(x) for x in v.array_value.values)
    return getattr(v, kind) if kind else None


def _attrs(kvs) -> dict:
    return {kv.key: _value(kv.value) for kv in kvs}


class OTLPReceiver:
    def __init__(self) -> None:
        self.spans: list[Span] = []
        self.paths: set[str] = set()
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["content-length"]))
                if self.headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                receiver._add(self.path, ExportTraceServiceRequest.FromString(body))
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_port}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> OTLPReceiver:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _add(self, path: str, req: ExportTraceServiceRequest) -> None:
        got = []
        for rs in req.resource_spans:
            service = _attrs(rs.resource.attributes).get("service.name", "")
            for ss in rs.scope_spans:
                for s in ss.spans:
                    got.append(Span(service, s.name, s.kind, s.trace_id.hex(), s.span_id.hex(),
                                    s.parent_span_id.hex(), _attrs(s.attributes),
                                    [(e.name, _attrs(e.attributes)) for e in s.events],
                                    s.status.code == s.status.STATUS_CODE_ERROR,
                                    s.start_time_unix_nano, s.end_time_unix_nano))
        with self._lock:
            self.paths.add(path)
            self.spans.extend(got)

    def wait_for(self, trace_id: str, want: set[tuple[str, str]], timeout_s: float = 60
                 ) -> list[Span]:
        """The trace's spans once every (service, name) in want has arrived."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                spans = [s for s in self.spans if s.trace_id == trace_id]
            if want <= {(s.service, s.name) for s in spans}:
                return spans
            assert time.monotonic() < deadline, (
                f"missing spans: {want - {(s.service, s.name) for s in spans}}")
            time.sleep(0.1)
