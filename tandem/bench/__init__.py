"""Serving benchmark for any OpenAI-compatible endpoint (`tandem bench`).

datasets (what to send) -> load (when to send it) -> client (one timed SSE
request) -> stats (percentiles, throughput, goodput) -> report (table, JSON, PNG).
"""
