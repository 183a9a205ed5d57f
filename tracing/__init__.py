"""OpenTelemetry traces across Tandem's processes: one trace per request, from the
router's HTTP handler through the prefill call, the KV pull and the decode stream.

- provider.py: the process's TracerProvider, installed only when tracing is asked
  for (--otlp-traces-endpoint, or the standard OTEL_EXPORTER_OTLP_* variables); off,
  nothing of the SDK is even imported and every span here is the API's no-op.
- rpc.py: W3C trace context in gRPC metadata (a client interceptor injects it, a
  server interceptor opens the server span under it).
- http.py: the router's server span per API request (an ASGI middleware).
- spans.py: small helpers the services use to open phase spans and add events.

Depends on nothing else of Tandem and loads no torch, so every layer may use it."""
