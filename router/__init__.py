"""The router: OpenAI-compatible HTTP edge, placement over prefill and decode
pools, and the request flow prefill -> KV handoff -> decode stream."""
