#!/usr/bin/env python3
"""Draws handoff latency against client count from `sidelock-bench --json`.

    python3 -m venv .venv-bench && .venv-bench/bin/pip install -r scripts/requirements-bench.txt
    .venv-bench/bin/python scripts/bench_chart.py bench.json docs/bench-handoff.png

One line per sidelock backend (contended workload) and per polling client
(the `SET NX PX` + sleep loop), p50 solid and p99 dashed, log scales.
"""

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def series(rows):
    rows = sorted(rows, key=lambda r: r["clients"])
    clients = [r["clients"] for r in rows if r["handoff"]["count"] > 0]
    p50 = [r["handoff"]["p50_us"] / 1000 for r in rows if r["handoff"]["count"] > 0]
    p99 = [r["handoff"]["p99_us"] / 1000 for r in rows if r["handoff"]["count"] > 0]
    return clients, p50, p99


def main():
    if len(sys.argv) != 3:
        sys.exit("usage: bench_chart.py BENCH.json OUT.png")
    with open(sys.argv[1]) as f:
        report = json.load(f)
    fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    lines = []
    for run in report["runs"]:
        if run["contended"]:
            label = "sidelock, " + run["backend"].split("://")[0]
            lines.append((label, run["contended"]))
    for polling in (report.get("baselines") or {}).get("polling", []):
        if polling["contended"]:
            lines.append((f"polling SET NX, sleep {polling['poll_ms']:g} ms", polling["contended"]))
    if not lines:
        sys.exit("no contended results in " + sys.argv[1])
    for i, (label, rows) in enumerate(lines):
        clients, p50, p99 = series(rows)
        color = f"C{i}"
        ax.plot(clients, p50, marker="o", color=color, label=f"{label} — p50")
        ax.plot(clients, p99, marker="x", linestyle="--", color=color, label=f"{label} — p99")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("clients contending for one lock")
    ax.set_ylabel("handoff latency, release → next grant (ms)")
    m = report["machine"]
    ax.set_title(f"Handoff latency ({m['cpus']} CPUs, loopback; sidelock {report['version']})")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(sys.argv[2])
    print("wrote", sys.argv[2])


if __name__ == "__main__":
    main()
