"""`tandem up`'s own flags reach the services that must agree on them: the bounded-KV
policy and the stream length go to every worker and to the router, which checks a
request's length as its workers do (README, Bounded KV)."""
from __future__ import annotations

from tandem.cli import build_parser
from tandem.supervisor import Cluster


def _flag(cmd: list[str], name: str) -> str | None:
    return cmd[cmd.index(name) + 1] if name in cmd else None


def test_kv_policy_and_stream_length_reach_every_worker_and_the_router(tmp_path) -> None:
    parser = build_parser()
    args = parser.parse_args(["up", "--model", str(tmp_path), "--prefill", "1", "--decode", "2",
                              "--kv-policy", "streaming:sinks=4,window=508",
                              "--max-stream-len", "30000"])
    cluster = Cluster(args, str(tmp_path))
    try:
        children = cluster.workers + [cluster.router]
        assert len(children) == 4
        for child in children:
            assert _flag(child.cmd, "--kv-policy") == "streaming:sinks=4,window=508", child.name
            assert _flag(child.cmd, "--max-stream-len") == "30000", child.name
            parser.parse_args(child.cmd[child.cmd.index("tandem.cli") + 1:])  # each one takes them
    finally:
        cluster._tmp.cleanup()
    plain = Cluster(parser.parse_args(["up", "--model", str(tmp_path)]), str(tmp_path))
    try:  # unset: each service keeps its own default
        assert all(_flag(c.cmd, "--kv-policy") is None for c in plain.workers + [plain.router])
    finally:
        plain._tmp.cleanup()
