"""/metrics under the floods of issue 31 (breaks 4 and 5), on a real agent (NVML replayed, eBPF off).

For each flood, from uid 65534 (nobody), against an agent without and one with TLS + basic auth:
one scrape a second (a new connection each, as Prometheus makes them) for --seconds, the share
answered 200 within 1 s, p50/p99 latency, the agent's RSS before, at its peak and 2 s after, its
threads at the peak, and gpuwatch_http_connections_total afterwards.

Floods (tests/http_floods.py): N connections that send part of a request and reconnect when dropped
(partial), that send 3 bytes of a TLS record header (tls), that complete the handshake then send part
of a request (tls-partial), that send 99 headers of 65 KB each, again and again (headers,
tls-headers).

Usage (repo root, as root): .venv/bin/python bench/http_floods.py [--seconds 60] [--only partial,tls]
Prints one table; numbers go to docs/security.md ("Measured under the floods").
"""
from __future__ import annotations

import argparse
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.conftest import FIXTURE, Agent, bcrypt_hash, series  # noqa: E402
from tests.http_floods import rss_mib, scrape, start_flood, threads  # noqa: E402
from tests.pki import make_pki  # noqa: E402

# (agent, flood, connections)
RUNS = [("plain", "partial", 40), ("plain", "headers", 40), ("plain", "partial", 500),
        ("tls+auth", "tls", 40), ("tls+auth", "tls-partial", 40), ("tls+auth", "partial", 40),
        ("tls+auth", "tls-headers", 40), ("tls+auth", "tls", 500)]


def start_agent(top: Path, tls: bool) -> tuple[Agent, dict]:
    args = ["--nvml-replay", str(FIXTURE), "--no-ebpf", "--no-cupti-sampling", "--no-baseline"]
    client: dict = {}
    if tls:
        pki = make_pki(top / "pki")
        (top / "web.yml").write_text(f"tls_server_config:\n  cert_file: {pki.server_cert}\n  key_file: "
                                     f"{pki.server_key}\nbasic_auth_users:\n  prometheus: {bcrypt_hash('s3cret')}\n")
        args += ["--web-config", str(top / "web.yml")]
        client = {"ctx": ssl.create_default_context(cafile=str(pki.ca)), "user": "prometheus", "password": "s3cret"}
    agent = Agent(top / ("tls" if tls else "plain"), *args)
    if tls:
        agent.url = f"https://127.0.0.1:{agent.port}/metrics"
    end = time.monotonic() + 60
    while not scrape(agent.url, **client)[0]:
        if time.monotonic() > end or agent.proc.poll() is not None:
            raise SystemExit(f"the agent did not serve: {agent.output()[-2000:]}")
        time.sleep(0.2)
    for _ in range(5):  # warm: caches and allocator settle before the baseline
        scrape(agent.url, **client)
    time.sleep(1)
    return agent, client


def run(agent: Agent, client: dict, flood_mode: str, n: int, seconds: float) -> dict:
    pid = agent.proc.pid
    before = rss_mib(pid)
    flood = start_flood(flood_mode, agent.port, n, seconds + 3)
    time.sleep(2)  # the flood fills up
    results, peak, peak_threads = [], before, threads(pid)
    next_at = time.monotonic()
    while len(results) < seconds:
        while time.monotonic() < next_at:
            peak, peak_threads = max(peak, rss_mib(pid)), max(peak_threads, threads(pid))
            time.sleep(min(0.1, max(0.0, next_at - time.monotonic())))
        next_at += 1.0
        results.append(scrape(agent.url, **client))
    out, _ = flood.communicate(timeout=30)
    time.sleep(2)
    lat = sorted(r[1] for r in results)
    good = sum(1 for ok, t, _ in results if ok and t < 1.0)
    return {"ok": f"{good}/{len(results)}", "ratio": good / len(results),
            "p50_ms": statistics.median(lat) * 1000, "p99_ms": lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1000,
            "rss": (before, peak, rss_mib(pid)), "threads": peak_threads, "flood_conns": int(out.strip() or 0),
            "errors": sorted({r[2] for r in results if r[2]})[:2]}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=int, default=60, help="scrapes (one a second) under each flood")
    ap.add_argument("--only", default="", help="comma-separated flood names to run (default: all)")
    a = ap.parse_args()
    only = set(filter(None, a.only.split(",")))
    top = Path(tempfile.mkdtemp(prefix="gw-http-floods-"))
    rows = []
    for kind in ("plain", "tls+auth"):
        runs = [r for r in RUNS if r[0] == kind and (not only or r[1] in only)]
        if not runs:
            continue
        agent, client = start_agent(top, kind == "tls+auth")
        try:
            for _, mode, n in runs:
                r = run(agent, client, mode, n, a.seconds)
                rows.append((kind, f"{mode} x{n}", r))
                print(kind, mode, n, r, flush=True)
            text = ""
            try:
                text = subprocess.run(["curl", "-sk", "-u", "prometheus:s3cret", agent.url], capture_output=True,
                                      text=True, timeout=10).stdout
            except Exception:  # noqa: BLE001 - the counters are a bonus
                pass
            counts = series(text, "gpuwatch_http_connections_total")
            print(kind, "gpuwatch_http_connections_total", {k.split('"')[1]: int(v) for k, v in counts.items()})
        finally:
            agent.stop()
    print()
    print(f"{'agent':<9} {'flood':<18} {'< 1 s':>9} {'p50 ms':>7} {'p99 ms':>7} {'RSS MiB before/peak/after':>26} "
          f"{'threads':>7} {'flood conns':>11}")
    for kind, what, r in rows:
        rss = "/".join(f"{x:.1f}" for x in r["rss"])
        print(f"{kind:<9} {what:<18} {r['ok']:>9} {r['p50_ms']:>7.1f} {r['p99_ms']:>7.1f} {rss:>26} "
              f"{r['threads']:>7} {r['flood_conns']:>11}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
