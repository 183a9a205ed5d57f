"""Everything the HTTP handlers share, built once at start-up (app.state.router)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TextIO

from engine.tokenizer import Tokenizer
from router.admission import Admission
from router.config import RouterConfig
from router.flow import RequestFlow
from router.metrics import RouterMetrics
from router.workers import WorkerPool


@dataclass
class RouterState:
    config: RouterConfig
    model_name: str
    tokenizer: Tokenizer
    pool: WorkerPool
    flow: RequestFlow
    metrics: RouterMetrics
    admission: Admission
    request_log: TextIO | None = None
    """Where each finished request's trace goes (--log-requests), one JSON line each."""
