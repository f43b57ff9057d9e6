#!/usr/bin/env bash
# The published benchmark run: starts a standalone ZooKeeper on a free
# loopback port (Debian's package, as scripts/setup.sh installs it), then
# `sidelock-bench` on every backend — memory, Redis and Redlock on servers the
# bench starts itself, ZooKeeper, PostgreSQL (the database in $BENCH_POSTGRES)
# — with the Redis baselines, draws the chart, then runs the client-process
# benchmark (scripts/client_procs.py: sidelock beside python-redis-lock, the
# plain Redis recipe and kazoo, on a Redis of its own and the same ZooKeeper).
#
#   scripts/bench.sh [out-dir] [extra sidelock-bench args…]
#
# Writes <out-dir>/results.json, results.txt, bench-handoff.png,
# client-procs.json and client-procs.txt (default out-dir: docs/bench).
# Raises the open-file limit to its hard limit; 10,000 waiters need 20,000.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-docs/bench}
shift || true
pg=${BENCH_POSTGRES:-postgres://postgres@127.0.0.1:5432/sidelock_bench}
mkdir -p "$out"
ulimit -n "$(ulimit -Hn)"  # 10,000 waiters are 10,000 connections from the bench

psql "${pg%/*}/postgres" -qtc "SELECT 1 FROM pg_database WHERE datname='${pg##*/}'" | grep -q 1 \
  || psql "${pg%/*}/postgres" -qc "CREATE DATABASE ${pg##*/}"

# ZooKeeper, standalone, full JIT, `mntr` allowed (the bench reads its counters).
zkdir=$(mktemp -d)
zkport=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
cat > "$zkdir/zoo.cfg" <<CFG
tickTime=200
dataDir=$zkdir/data
clientPort=$zkport
clientPortAddress=127.0.0.1
4lw.commands.whitelist=mntr,ruok
admin.enableServer=false
minSessionTimeout=400
maxSessionTimeout=60000
maxClientCnxns=0
CFG
echo "log4j.rootLogger=WARN, CONSOLE
log4j.appender.CONSOLE=org.apache.log4j.ConsoleAppender
log4j.appender.CONSOLE.layout=org.apache.log4j.PatternLayout
log4j.appender.CONSOLE.layout.ConversionPattern=%d{ISO8601} %-5p %m%n" > "$zkdir/log4j.properties"
java -Xms64m -Xmx512m -Dzookeeper.jmx.log4j.disable=true \
  -cp "$zkdir:/usr/share/java/zookeeper.jar:/usr/share/java/slf4j-log4j12.jar:/usr/share/java/log4j-1.2.jar" \
  org.apache.zookeeper.server.quorum.QuorumPeerMain "$zkdir/zoo.cfg" > "$zkdir/zookeeper.log" 2>&1 &
zkpid=$!
trap 'kill $zkpid 2>/dev/null; wait $zkpid 2>/dev/null || true; rm -rf "$zkdir"' EXIT
for _ in $(seq 600); do
  [[ "$(exec 3<>/dev/tcp/127.0.0.1/$zkport && printf ruok >&3 && cat <&3)" == imok ]] 2>/dev/null && break
  sleep 0.1
done

# The Python tools' venv, rebuilt whenever their requirements change.
if ! cmp -s scripts/requirements-bench.txt .venv-bench/requirements.txt 2>/dev/null; then
  rm -rf .venv-bench
  python3 -m venv .venv-bench
  .venv-bench/bin/pip install -q -r scripts/requirements-bench.txt
  cp scripts/requirements-bench.txt .venv-bench/requirements.txt
fi

cargo build --release --locked --workspace --bins
target/release/sidelock-bench --workload all \
  --backend memory --backend redis --backend redlock --backend zookeeper --backend postgres \
  --spawn-redis --spawn-redlock --zookeeper "zk://127.0.0.1:$zkport" --postgres "$pg" \
  --json "$out/results.json" "$@" | tee "$out/results.txt"

.venv-bench/bin/python scripts/bench_chart.py "$out/results.json" "$out/bench-handoff.png"

.venv-bench/bin/python scripts/client_procs.py --sidelock target/release/sidelock \
  --zookeeper "127.0.0.1:$zkport" --zookeeper-pid "$zkpid" \
  --json "$out/client-procs.json" | tee "$out/client-procs.txt"
