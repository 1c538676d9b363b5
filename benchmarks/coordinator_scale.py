"""The real coordinator process under many engines' stats (part a of control_plane.py).

512 engine processes do not fit a small machine, so simulated engines are hosted a few
processes at a time, each engine with its own PUSH socket (as real engines have), sending
``EngineStats`` at ``--hz`` with ``seq`` counting up and phases spread over the period.
A SUB socket (an API server's view) records when each ``LoadSnapshot`` arrives. Publish
latency of update (rank, seq=k) = arrival of the first snapshot holding seq >= k for that
rank − its send time (``time.monotonic`` is one clock for every process on Linux). The
coordinator batches changes into one snapshot per 100 ms, so ~50 ms median is by design.

    python benchmarks/coordinator_scale.py --engines 64 256 512 [--seconds 10]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import random
import statistics
import threading
import time
from pathlib import Path

import zmq
from common import free_port

from hybridlb import lifecycle
from hybridlb.coordinator import run_coordinator
from hybridlb.protocol import EngineStats, encoder, loads_decoder

_spawn = multiprocessing.get_context("spawn")
_TICK = os.sysconf("SC_CLK_TCK")
WARMUP_S = 2.0


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of one process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


def rss_mib(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS"))) / 1024


def publish(ranks: list[int], address: str, seconds: float, hz: float, parent) -> None:
    """One host process of simulated engines: connect, say ready, then send every rank's
    stats at ``hz`` from the start time the parent answers with."""
    lifecycle.die_with_parent()
    context = zmq.Context()
    sockets = {}
    for rank in ranks:
        sock = sockets[rank] = context.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 64)  # as engines set it
        sock.connect(address)
    period, rng = 1.0 / hz, random.Random(ranks[0])
    phases = sorted((rank * 0.6180339 % 1.0 * period, rank) for rank in ranks)  # spread over the period
    parent.send("ready")
    start_at = parent.recv()
    sent: dict[int, list[float]] = {rank: [] for rank in ranks}
    for tick in range(int(seconds * hz)):
        for phase, rank in phases:
            delay = start_at + tick * period + phase - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            seq = len(sent[rank]) + 1
            stats = EngineStats(rank, rng.randrange(64), rng.randrange(8), round(rng.random(), 4), seq=seq,
                                epoch=1, busy_s=round(tick * period, 3), steps=tick * 5)
            sent[rank].append(time.monotonic())
            try:
                sockets[rank].send(encoder.encode(stats), zmq.NOBLOCK)
            except zmq.Again:
                sent[rank][-1] = float("nan")  # dropped at the sender, as an engine would
    parent.send((sent, cpu_seconds(os.getpid())))
    context.destroy(linger=0)


def _listen(address: str, until: float, received: list[tuple[float, bytes]]) -> None:
    """Append every snapshot that arrives before ``until``, with its arrival time."""
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(address)
    try:
        while (left := until - time.monotonic()) > 0:
            if sub.poll(int(left * 1000) + 1):
                payload = sub.recv()
                received.append((time.monotonic(), payload))
    finally:
        context.destroy(linger=0)


def _latencies(sent: dict[int, list[float]], snapshots: list[tuple[float, bytes]], window: tuple[float, float]):
    """Delivery latency of every update sent inside ``window``; also the count never delivered."""
    seen: dict[int, int] = {}
    latencies = []
    for arrived, payload in snapshots:
        for stats in loads_decoder.decode(payload).engines:
            previous = seen.get(stats.rank, 0)
            for seq in range(previous + 1, stats.seq + 1):
                at = sent[stats.rank][seq - 1]
                if window[0] <= at <= window[1]:
                    latencies.append(arrived - at)
            seen[stats.rank] = max(previous, stats.seq)
    in_window = sum(window[0] <= t <= window[1] for times in sent.values() for t in times)
    return latencies, in_window - len(latencies)


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] if ordered else float("nan")


def measure(engines: int, seconds: float, hz: float = 10.0, hosts: int = 4) -> dict:
    """Run the coordinator with ``engines`` simulated publishers; one result row."""
    stats_address, loads_address = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    coordinator = _spawn.Process(target=run_coordinator, args=(stats_address, loads_address, engines),
                                 name="hybridlb:coordinator", daemon=True)
    coordinator.start()
    publishers = []
    try:
        _wait_for_heartbeat(loads_address)
        for index in range(hosts):
            ours, theirs = _spawn.Pipe()
            process = _spawn.Process(target=publish, args=(list(range(index, engines, hosts)), stats_address,
                                                           WARMUP_S + seconds, hz, theirs), daemon=True)
            process.start()
            publishers.append((process, ours))
        start_at, snapshots, listener = _start(publishers, loads_address, WARMUP_S + seconds)
        window = (start_at + WARMUP_S, start_at + WARMUP_S + seconds - 0.3)  # the last may miss the last snapshot
        time.sleep(max(0.0, window[0] - time.monotonic()))
        cpu_before, wall_before = cpu_seconds(coordinator.pid), time.monotonic()
        time.sleep(max(0.0, window[1] - time.monotonic()))
        cpu = (cpu_seconds(coordinator.pid) - cpu_before) / (time.monotonic() - wall_before)
        rss = rss_mib(coordinator.pid)
        sent, publisher_cpu = {}, 0.0
        for _, pipe in publishers:
            times, used = pipe.recv()
            sent.update(times)
            publisher_cpu += used
        listener.join()
    finally:
        for process in [coordinator, *(p for p, _ in publishers)]:
            process.terminate()
            process.join(5)
            if process.is_alive():
                process.kill()
    latencies, undelivered = _latencies(sent, snapshots, window)
    measured = [(t, p) for t, p in snapshots if window[0] <= t <= window[1]]
    return {
        "engines": engines, "hz": hz, "seconds": seconds, "publisher_processes": hosts,
        "updates": len(latencies) + undelivered, "undelivered": undelivered,
        "dropped_at_sender": sum(t != t for times in sent.values() for t in times),
        "p50_ms": _percentile(latencies, 0.5) * 1000, "p99_ms": _percentile(latencies, 0.99) * 1000,
        "max_ms": max(latencies, default=float("nan")) * 1000,
        "coordinator_cpu_pct": cpu * 100, "coordinator_rss_mib": rss,
        "publishers_cpu_pct": publisher_cpu / (WARMUP_S + seconds) * 100,
        "snapshot_bytes": int(statistics.fmean(len(p) for _, p in measured)) if measured else 0,
        "snapshots_per_s": len(measured) / (window[1] - window[0]),
    }


def _wait_for_heartbeat(address: str, timeout_s: float = 30.0) -> None:
    """The coordinator publishes at least every second: one snapshot means it is up."""
    heard: list = []
    deadline = time.monotonic() + timeout_s
    while not heard and time.monotonic() < deadline:
        _listen(address, time.monotonic() + 1.5, heard)
    if not heard:
        raise RuntimeError(f"the coordinator published nothing on {address} in {timeout_s:.0f} s")


def _start(publishers: list, loads_address: str, seconds: float):
    """Once every host is connected: start the listener, then tell the hosts when to begin."""
    for _, pipe in publishers:
        if not pipe.poll(60) or pipe.recv() != "ready":
            raise RuntimeError("a publisher process did not start")
    start_at = time.monotonic() + 0.5
    snapshots: list[tuple[float, bytes]] = []
    listener = threading.Thread(target=_listen, args=(loads_address, start_at + seconds + 0.5, snapshots))
    listener.start()
    for _, pipe in publishers:
        pipe.send(start_at)
    return start_at, snapshots, listener


def print_row(row: dict) -> None:
    print(f"  {row['engines']:>5} engines x {row['hz']:g} Hz  publish P50 {row['p50_ms']:6.1f} ms  "
          f"P99 {row['p99_ms']:6.1f} ms  coordinator CPU {row['coordinator_cpu_pct']:5.1f}%  "
          f"RSS {row['coordinator_rss_mib']:5.0f} MiB  snapshot {row['snapshot_bytes'] / 1024:6.1f} KiB  "
          f"{row['snapshots_per_s']:4.1f} snapshots/s  undelivered {row['undelivered']}/{row['updates']}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", type=int, nargs="+", default=[64, 256, 512])
    parser.add_argument("--seconds", type=float, default=10.0, help="measured time per size (after warm-up)")
    parser.add_argument("--hz", type=float, default=10.0)
    args = parser.parse_args()
    for engines in args.engines:
        print_row(measure(engines, args.seconds, args.hz))


if __name__ == "__main__":
    main()
