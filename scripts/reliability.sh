#!/usr/bin/env bash
# The long reliability run, whose figures RELIABILITY.md reports:
#   scripts/reliability.sh [seconds per backend for the safety checker, default 60]
# 1. the safety checker on every backend for that long, every lock kind
#    (exclusive, shared, reentrant, semaphores), and finding 1's semaphore
#    workload for as long (JSON reports in target/safety-<backend>.json);
# 2. every fault and partition test (Redis, Sentinel, Redlock, PostgreSQL,
#    ZooKeeper, network namespaces) and the worst-day tests;
# 3. schemathesis with 600 examples per operation (over 5,000 requests);
# 4. cargo-fuzz on the parameter parsing for the same number of seconds,
#    growing the kept corpus in fuzz/corpus/params.
# Installs what it needs first (scripts/setup.sh, cargo-fuzz).
set -euo pipefail
cd "$(dirname "$0")/.."
seconds="${1:-60}"
scripts/setup.sh
cargo build --locked --bins

# The default profile: no time limit, as a long run is meant to be long.
SIDELOCK_CHECK_SECONDS="$seconds" cargo nextest run --locked -E 'test(/^safety::/)'
cargo nextest run --locked --profile ci \
  -E 'test(/^(partition|redis|redlock|postgres|zookeeper|reliability)::/)'
scripts/fuzz-api.sh 600

command -v cargo-fuzz >/dev/null || cargo install --locked cargo-fuzz
(cd fuzz && RUSTC_BOOTSTRAP=1 cargo fuzz run params corpus/params -- -max_total_time="$seconds")
echo "reliability: all long runs passed (safety checker ${seconds}s per backend)"
