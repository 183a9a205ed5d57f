"""KV transfer bandwidth: NIXL and TCP between two processes on loopback,
next to a one-thread in-process ``dst.copy_(src)`` of the same size.

    python bench/bench_kvtransfer.py [--reps-scale 1.0]

A source process holds a bf16 KV cache of 256 KiB blocks behind both a
NixlSource and a TcpSource (one lease covers every block); this process reads
1, 4, 16 and 64 MiB of randomly chosen source blocks into randomly chosen local
blocks (scattered both sides, as after a real prefill) and reports the median
over a few reads, from ``start_read`` to DONE (TCP includes its connect).
Handshake data crosses processes as serialized ``HandshakeReply`` protobufs.
Prints a table; asserts nothing. Runs in well under two minutes.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvtransfer.base import (CompatRecord, KVBackendUnavailable, KVReader, PeerId,  # noqa: E402
                             ReadPlan, TransferState, get_backend)

MiB = 1 << 20
SIZES_MIB = (1, 4, 16, 64)
SHAPE = (8, 2, 16, 4, 128)  # [L, 2, B, Hkv, D] bf16: 256 KiB per block
NUM_BLOCKS = 64 * MiB // (256 * 1024) + 16
REPS = {1: 20, 4: 10, 16: 5, 64: 3}
COLD_POOL_MIB = 512  # > any LLC we run on (105 MiB here), for the cold-copy column


def _kv(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((NUM_BLOCKS, *SHAPE), generator=g).to(torch.bfloat16)


def _source_main(conn: Any, backends: list[str]) -> None:
    from kvtransfer.lease import LeaseTable
    from kvtransfer.link import info_to_proto

    torch.set_num_threads(1)
    kv = _kv(1)
    compat = CompatRecord.from_kv(kv, "bench")
    leases = LeaseTable()
    lease = leases.grant("bench", range(NUM_BLOCKS), ttl_s=3600)
    sources = []
    for name in backends:
        source = get_backend(name).source()  # type: ignore[arg-type]
        source.register(kv, compat, leases.check_readable)
        source.serve("127.0.0.1", 0)
        sources.append(source)
        conn.send_bytes(info_to_proto(source.handshake_info(f"bench-{name}")).SerializeToString())
    conn.send_bytes(str(lease.epoch).encode())
    conn.recv_bytes()  # until the reader is done
    for source in sources:
        source.close()


def _time_read(reader: KVReader, peer: PeerId, plan: ReadPlan) -> float:
    t0 = time.perf_counter()
    handle = reader.start_read(peer, plan)
    if reader.name == "nixl":
        while (state := reader.poll(handle)) is TransferState.PENDING:
            pass  # NIXL progresses only from the caller's poll
    else:
        state = reader.wait(handle, 60)  # a spinning poll would starve the reading thread (GIL)
    elapsed = time.perf_counter() - t0
    if state is not TransferState.DONE:
        raise RuntimeError(f"{reader.name} read ended {state}: {handle.error}")
    return elapsed


def _bench_backend(name: str, info_bytes: bytes, epoch: int, reps_scale: float,
                   block_bytes: int) -> tuple[dict[int, float], float]:
    from kvtransfer.link import info_from_proto
    from proto import kv_link_pb2 as pb

    kv = torch.zeros((NUM_BLOCKS, *SHAPE), dtype=torch.bfloat16)
    compat = CompatRecord.from_kv(kv, "bench")
    reader = get_backend(name).reader()  # type: ignore[arg-type]
    reader.register(kv, compat)
    reply = pb.HandshakeReply()
    reply.ParseFromString(info_bytes)
    peer = reader.connect(info_from_proto(reply))
    g = torch.Generator().manual_seed(2)
    first = _time_read(reader, peer, ReadPlan("bench", epoch, (0,), (0,)))  # includes wire-up
    results: dict[int, float] = {}
    for size in SIZES_MIB:
        n = size * MiB // block_bytes
        times = []
        for _ in range(2 + max(1, round(REPS[size] * reps_scale))):
            remote = torch.randperm(NUM_BLOCKS, generator=g)[:n].tolist()
            local = torch.randperm(NUM_BLOCKS, generator=g)[:n].tolist()
            times.append(_time_read(reader, peer, ReadPlan("bench", epoch, remote, local)))
        results[size] = size * MiB / statistics.median(times[2:]) / 1e9
    src = _kv(1)
    assert torch.equal(kv[local[-1]], src[remote[-1]]), f"{name}: wrong bytes"
    reader.close()
    return results, first


def _bench_copy(reps_scale: float, cold: bool) -> dict[int, float]:
    """``dst.copy_(src)`` on one thread. Hot: the same two buffers every time
    (they stay in cache up to the LLC size). Cold: rotating through pools larger
    than the LLC, as a transfer of freshly computed KV into idle blocks sees."""
    torch.set_num_threads(1)
    pool = COLD_POOL_MIB * MiB if cold else 0
    src_pool = torch.ones(max(pool, max(SIZES_MIB) * MiB), dtype=torch.uint8)
    dst_pool = torch.ones_like(src_pool)
    results = {}
    for size in SIZES_MIB:
        slots = max(1, pool // (size * MiB))
        times = []
        for rep in range(2 + max(1, round(REPS[size] * reps_scale))):
            at = (rep % slots) * size * MiB
            src, dst = src_pool[at:at + size * MiB], dst_pool[at:at + size * MiB]
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
        results[size] = size * MiB / statistics.median(times[2:]) / 1e9
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps-scale", type=float, default=1.0, help="multiply read repetitions")
    args = parser.parse_args()
    backends = ["tcp"]
    try:
        get_backend("nixl")
        backends.insert(0, "nixl")
    except KVBackendUnavailable as e:
        print(f"nixl skipped: {e}")
    block_bytes = CompatRecord.from_kv(torch.empty((1, *SHAPE), dtype=torch.bfloat16), "b").block_bytes

    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_source_main, args=(child, backends), daemon=True)
    proc.start()
    try:
        infos = [conn.recv_bytes() for _ in backends]
        epoch = int(conn.recv_bytes())
        bw = {"copy": _bench_copy(args.reps_scale, cold=False),
              "copy_cold": _bench_copy(args.reps_scale, cold=True)}
        first = {}
        for name, info in zip(backends, infos):
            bw[name], first[name] = _bench_backend(name, info, epoch, args.reps_scale, block_bytes)
    finally:
        conn.send_bytes(b"done")
        proc.join(20)
        if proc.is_alive():
            proc.kill()

    print(f"\nKV transfer bandwidth, GB/s (bf16, {block_bytes // 1024} KiB blocks, scattered ids, "
          f"median; {os.cpu_count()} CPUs)")
    cols = ["copy", "copy cold", *backends]
    cols += ["nixl/copy", "nixl/copy cold"] if "nixl" in backends else []
    print(f"{'size':>8} | " + " | ".join(f"{c:>14}" for c in cols))
    print("-" * (11 + 17 * len(cols)))
    for size in SIZES_MIB:
        row = [bw["copy"][size], bw["copy_cold"][size]] + [bw[b][size] for b in backends]
        if "nixl" in backends:
            row += [bw["nixl"][size] / bw["copy"][size], bw["nixl"][size] / bw["copy_cold"][size]]
        print(f"{size:>4} MiB | " + " | ".join(f"{v:14.2f}" for v in row))
    print("copy = in-process dst.copy_(src), torch.set_num_threads(1), same buffers each time; "
          f"copy cold = rotating through {COLD_POOL_MIB} MiB pools")
    for name, seconds in first.items():
        print(f"first {name} read (one block, includes connection set-up): {seconds * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
