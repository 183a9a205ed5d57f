"""The cross-process ``source`` and ``reader`` fixtures of the backend tests (test_nixl.py,
test_tcp.py). A module that uses them names its backend and its source's seed:
``BACKEND, SOURCE_SEED = "tcp", 11``."""
from __future__ import annotations

import pytest
import torch

from kvtransfer.base import get_backend
from tests.kvtransfer.utils import Dest, SourceProcess


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def source(request: pytest.FixtureRequest):
    """A source worker process of the module's BACKEND, one per dtype; no lease may outlive
    the module's tests."""
    with SourceProcess(request.module.BACKEND, request.param,
                       seed=request.module.SOURCE_SEED) as src:
        yield src
        assert src.active() == 0, "leak: a lease outlived the tests"


@pytest.fixture
def reader(source: SourceProcess):
    """A reader of the same backend into a fresh Dest (``reader.dest``); it ends with no read
    in flight and no lease left active."""
    dest = Dest.make(source.dtype)
    rd = get_backend(source.backend).reader()
    rd.register(dest.kv, dest.compat)
    rd.dest = dest  # type: ignore[attr-defined]
    yield rd
    assert rd.in_flight() == 0, "leak: a read still in flight"
    rd.close()
    assert source.active() == 0, "leak: lease left active"
