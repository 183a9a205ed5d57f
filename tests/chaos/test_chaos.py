"""The chaos suite, bounded (about 90 seconds): `tandem up --prefill 2 --decode 2` on the
tiny model under mixed load while a prefill worker, a decode worker and the router
are killed with SIGKILL and clients misbehave (tandem/bench/chaos.py says what is
sent and what is audited). `python bench/chaos.py --minutes N` is the soak."""
from __future__ import annotations

import pytest

from tandem.bench.chaos import Fault, UpCluster, make_cases, references, run_load
from tandem.process import free_port

# each fault of the soak once, 8 s apart, and load on for 10 s after the last (then on
# until MIN_OK answers came back)
LOAD_S = 32.0
FAULTS = [Fault(6, "prefill"), Fault(14, "decode"), Fault(22, "router")]
MIN_OK = 30


@pytest.mark.slow
def test_no_fault_or_client_strands_a_block_or_a_request(tiny_model_dir) -> None:
    cases = make_cases(vocab=320)
    refs = references(str(tiny_model_dir), cases)
    cluster = UpCluster(str(tiny_model_dir), free_port(), [
        "--prefill", "2", "--decode", "2", "--dtype", "float32", "--kv-blocks", "128",
        "--max-model-len", "256", "--local-prefill-threshold", "8", "--swap-space", "0.01",
        "--kv-transfer", "tcp", "--decode-arg=--max-num-seqs=8"])
    try:
        cluster.wait_ready()
        # on a loaded box the load runs on past LOAD_S until MIN_OK answers came back
        report = run_load(cluster, cases, refs, LOAD_S, FAULTS, clients=6, min_ok=MIN_OK,
                          max_extra_s=180.0)
    finally:
        cluster.stop()
    print(report.summary())
    counts = report.counts()
    assert report.faults_done == ["prefill@6s", "decode@14s", "router@22s"]
    assert counts.get("ok", 0) >= MIN_OK, report.summary()
    assert not report.wrong, report.wrong[:5]
    assert not report.late, report.late[:5]
    assert not report.unclear, report.unclear[:5]
    assert not report.leaks, report.leaks


def test_the_audit_gives_a_killed_routers_leases_the_time_their_workers_take_to_end_them(
        ) -> None:
    """The run of 2026-12-05 killed the router at 22 s with two prefill handles in its
    hands; their blocks were freed by the lease TTL (30 s) at 52.3 and 52.5 s, and the
    audit, starting at 32 s with 20 s per worker, called them leaks at 52 s. The prefill
    workers now end a gone router's leases 5 s after its KV event streams closed
    (prefill_svc/router_leases.py): the audit waits for that after the last router kill,
    and 20 s at least, and a lease only the TTL would free, as in that run, is a leak."""
    from prefill_svc.router_leases import GONE_AFTER_S
    from tandem.bench.chaos import AUDIT_WAIT_S, audit_deadline
    from worker.config import KVTransferConfig

    assert audit_deadline(23.0, [(22.0, 24.0)], wait_s=0.0) == 22.0 + GONE_AFTER_S + 1.0
    assert audit_deadline(32.0, []) == 32.0 + AUDIT_WAIT_S  # no router kill: 20 s
    assert audit_deadline(32.0, [(22.0, 24.0)]) == 32.0 + AUDIT_WAIT_S
    # the run above: its TTL-freed leases (52.3 s) now fall after the audit's deadline
    assert audit_deadline(32.0, [(22.0, 24.0)]) < 22.0 + KVTransferConfig.lease_ttl_s + 0.3
