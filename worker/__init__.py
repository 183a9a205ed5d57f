"""What every worker service (prefill_svc, decode_svc) shares: its config, the gRPC
server with health checking and reflection, KV event fan-out, load reports,
metrics, and conversions between proto messages and engine types."""
