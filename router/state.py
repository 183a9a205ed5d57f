"""Everything the HTTP handlers share (app.state.router), and its life: discovery
feeding the worker pool, built at start-up and torn down at shutdown."""
from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator, TextIO

from core.tokenizer import Tokenizer
from router.admission import Admission
from router.config import RouterConfig
from router.discovery.base import Discovery
from router.flow import RequestFlow
from router.loras import RouterLoRAs
from router.http.offload import EdgeWork
from router.metrics import RouterMetrics
from router.responses_store import ResponseStore
from router.workers import WorkerPool

log = logging.getLogger(__name__)
DISCOVERY_WAIT_S = 10.0
"""How long start-up waits for discovery's first list of workers."""
PARSING_THREADS = 2
PARSING_BACKLOG = 1024
"""Default (a RouterState built by hand); running_state sizes it by --max-connections."""
CONSTRAINT_THREADS = 2
CONSTRAINT_BACKLOG = 64
"""Requests whose constraints may wait for or be in a check at once (429 beyond): each
can take up to the compile and search budgets (engine/guided), so a long queue of them
is a long wait."""


@dataclass
class RouterState:
    config: RouterConfig
    model_name: str
    tokenizer: Tokenizer
    pool: WorkerPool
    flow: RequestFlow
    metrics: RouterMetrics
    admission: Admission
    parsing: EdgeWork = field(default_factory=lambda: EdgeWork("parsing", PARSING_THREADS,
                                                               PARSING_BACKLOG))
    """Parsing, tokenizing and checking requests, off the event loop (router/http/offload.py)."""
    constraints: EdgeWork = field(default_factory=lambda: EdgeWork(
        "constraint", CONSTRAINT_THREADS, CONSTRAINT_BACKLOG))
    """Checking and compiling output constraints, apart from the rest."""
    request_log: TextIO | None = None
    """Where each finished request's trace goes (--log-requests), one JSON line each."""
    responses: ResponseStore = field(default_factory=ResponseStore)
    """Stored /v1/responses conversations, per API key (previous_response_id)."""
    loras: RouterLoRAs | None = None
    """The LoRA adapters the workers serve (router/loras.py); made from pool when None."""

    def __post_init__(self) -> None:
        if self.loras is None:
            self.loras = RouterLoRAs(self.pool)


@asynccontextmanager
async def running_state(config: RouterConfig, discovery: Discovery, secret: bytes,
                        tokenizer: Tokenizer | None = None) -> AsyncIterator[RouterState]:
    """The router's state while it serves: the pool follows discovery until exit."""
    pool = WorkerPool(secret)
    first = asyncio.Event()

    async def follow() -> None:
        async for endpoints in discovery.watch():
            await pool.apply(endpoints)
            first.set()

    watcher = asyncio.create_task(follow())
    parsing = EdgeWork("parsing", PARSING_THREADS, config.max_connections)  # one per request
    constraints = EdgeWork("constraint", CONSTRAINT_THREADS, CONSTRAINT_BACKLOG)
    log_file = open(config.log_requests, "a", buffering=1) if config.log_requests else None
    try:
        try:
            await asyncio.wait_for(first.wait(), timeout=DISCOVERY_WAIT_S)
        except asyncio.TimeoutError:
            log.warning("discovery returned no workers within %.0f s; serving anyway",
                        DISCOVERY_WAIT_S)
        await pool.wait_healthy(timeout_s=5.0)
        tok = tokenizer or Tokenizer.load(config.model)
        yield RouterState(
            config=config, tokenizer=tok, pool=pool, flow=RequestFlow(config, tok, pool),
            model_name=config.model_name or Path(config.model).name.removesuffix(".gguf"),
            metrics=RouterMetrics(), request_log=log_file,
            admission=Admission(config.max_inflight, config.max_queue, pool.has_decode_room),
            parsing=parsing, constraints=constraints)
    finally:
        parsing.close()
        constraints.close()
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
        await pool.stop()
        if log_file is not None:
            log_file.close()
