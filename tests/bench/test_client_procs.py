"""Smoke test of scripts/client_procs.py, the lock benchmark with client processes.

Runs the harness for a fraction of a second per point with 2 processes on
every system and workload, with the debug sidecar that CI builds
(``cargo build --workspace --locked --bins``), and checks that its JSON is
complete: every system and workload present, counts, rates and latencies
positive, backend operations counted, no errors. CPU readings are in clock
ticks (10 ms), so over 0.3 s they are only required to be present.

It needs redis-server and ZooKeeper, which scripts/setup.sh installs; without
them it fails, saying so, and never skips.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "client_procs.py"
SIDELOCK = REPO / "target" / "debug" / "sidelock"
PROCS = 2


def harness():
    """The harness as a module (its lists of systems and workloads, its checks)."""
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import client_procs
    except SystemExit as e:  # it exits when a Python package is missing
        pytest.fail(f"{e}; scripts/setup.sh builds .venv with them", pytrace=False)
    return client_procs


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One short run of the harness: (module, report, printed tables)."""
    cp = harness()
    if missing := cp.missing_tools():
        pytest.fail(f"missing {'; '.join(missing)}: run scripts/setup.sh (as root) to install it", pytrace=False)
    if not SIDELOCK.is_file():
        pytest.fail(f"{SIDELOCK} is missing: cargo build --workspace --locked --bins", pytrace=False)
    out = tmp_path_factory.mktemp("client-procs") / "client-procs.json"
    argv = [sys.executable, str(SCRIPT), "--sidelock", str(SIDELOCK), "--duration", "0.3", "--warmup", "0.1"]
    argv += ["--procs-uncontended", str(PROCS), "--procs-contended", str(PROCS), "--json", str(out)]
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=600)
    if not out.is_file():
        pytest.fail(f"the harness wrote no JSON (exit {done.returncode}):\n{done.stderr[-4000:]}", pytrace=False)
    return cp, json.loads(out.read_text()), done


def rows(report: dict, workload: str) -> list[dict]:
    return report["results"].get(workload, [])


def test_every_system_and_workload_is_measured(run):
    cp, report, _ = run
    for workload in cp.WORKLOADS:
        measured = [(r["system"], r["procs"]) for r in rows(report, workload)]
        assert measured == [(s, PROCS) for s in cp.SYSTEMS], workload


def test_no_errors(run):
    _, report, done = run
    assert report["errors"] == [], "\n".join(report["errors"])
    for rs in report["results"].values():
        for r in rs:
            assert (r["errors"], r.get("overlaps", 0)) == (0, 0), r
    assert done.returncode == 0, done.stderr[-4000:]


def assert_costs(r: dict) -> None:
    """Backend operations counted; CPU readings present where a process is known."""
    assert r["commands_per_op"] > 0 and r["top_level_per_op"] > 0, r
    assert r["commands_per_op"] >= r["top_level_per_op"], r
    cpu = r["cpu_us_per_op"]
    assert cpu["backend"] is not None and cpu["backend"] >= 0, r
    assert cpu["clients"] > 0, r
    if r["system"].startswith("sidelock-"):
        assert cpu["sidecars"] is not None and cpu["sidecars"] >= 0, r
    else:
        assert cpu["sidecars"] is None, r


def test_uncontended_numbers(run):
    _, report, _ = run
    for r in rows(report, "uncontended"):
        assert r["pairs"] > 0 and r["pairs_per_s"] > 0, r
        for lat in (r["acquire_us"], r["release_us"]):
            assert 0 < lat["p50"] <= lat["p99"] <= lat["max"], r
        assert_costs(r)


def test_contended_numbers(run):
    _, report, _ = run
    for r in rows(report, "contended"):
        # The wait rule makes every grant but the first a handoff, never a regrant.
        assert r["handoffs"] > 0 and r["handoffs_per_s"] > 0, r
        assert (r["handoffs"], r["regrants"]) == (r["grants"] - 1, 0), r
        assert 0 < r["handoff_us"]["p50"] <= r["handoff_us"]["p99"], r
        assert r["max_wait_ms"] > 0, r
        assert_costs(r)


def test_greedy_counts_regrants(run):
    _, report, _ = run
    for r in rows(report, "contended_greedy"):
        assert r["grants"] > 0 and r["grants_per_s"] > 0, r
        # Every grant but the first went to another process or to the releaser.
        assert r["handoffs"] + r["regrants"] == r["grants"] - 1, r
        assert 0 <= r["regrant_share"] <= 1, r
        assert r["max_wait_ms"] > 0, r
        assert_costs(r)


def test_tables_are_printed(run):
    _, _, done = run
    for title in ("### Uncontended", "### Contended (one lock", "### Contended, greedy"):
        assert title in done.stdout, done.stdout
