"""`api`: one cluster shared by the router tests that need real workers and the official
client: a prefill and a decode worker on the tiny model behind a router whose
threshold sends prompts of more than 4 uncached tokens through the prefill worker
(disaggregated) and shorter ones to the decode worker alone (local prefill)."""
from __future__ import annotations

import contextlib

import httpx
import openai
import pytest

from core.tokenizer import Tokenizer

from tests.cluster.launch import cluster

WORKER_ARGS = ["--dtype", "float32", "--kv-blocks", "256", "--max-model-len", "1024"]


@pytest.fixture(scope="session")
def api(tiny_model_dir):
    with api_cluster(tiny_model_dir) as c:
        yield c


@contextlib.contextmanager
def api_cluster(model_dir):
    """The `api` cluster on model_dir, with the official client and requests_total."""
    with cluster(model_dir, "tcp", worker_args=WORKER_ARGS,
                 router_args=["--local-prefill-threshold", "4", "--max-model-len", "1024"]) as c:
        c.client = openai.OpenAI(base_url=c.url + "/v1", api_key="unused", max_retries=0,
                                 timeout=120)
        c.requests_total = lambda **labels: requests_total(c.url, **labels)
        yield c


def requests_total(url: str, **labels: str) -> float:
    """The router's tandem:router_requests_total summed over the series with these
    labels (path=..., finish_reason=...)."""
    body = httpx.get(url + "/metrics", timeout=10).text
    want = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(float(line.rsplit(" ", 1)[1]) for line in body.splitlines()
               if line.startswith("tandem:router_requests_total{")
               and all(w in line for w in want))


@pytest.fixture(scope="session")
def tiny_tok(tiny_model_dir) -> Tokenizer:
    """The tiny model's tokenizer (byte-level: one token per byte, specials 0-2)."""
    return Tokenizer.load(tiny_model_dir)
