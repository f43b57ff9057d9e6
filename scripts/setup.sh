#!/usr/bin/env bash
# Installs and starts, when missing, everything the test suite needs on a
# fresh Debian machine (run as root): Redis and Sentinel, ZooKeeper (Java)
# and the Curator recipes, PostgreSQL (started), libfaketime (to step a test
# server's clock), Chromium with its driver, cargo-nextest, and the Python
# tools in ./.venv.
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
for pkg in redis-server redis-sentinel redis-tools zookeeper libcurator-recipes-java default-jdk-headless \
           postgresql postgresql-contrib libfaketime chromium chromium-driver iproute2 procps curl; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || need_apt+=("$pkg")
done
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "setup: installing ${need_apt[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  # Package scripts may try to start services; the tests start their own servers.
  apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
fi

# PostgreSQL: the tests create their own schemas in the machine's cluster
# (and throwaway clusters of their own from /usr/lib/postgresql/*/bin).
if ! pg_isready -q -h 127.0.0.1 -p 5432 2>/dev/null; then
  echo "setup: starting PostgreSQL"
  cluster=$(ls /usr/lib/postgresql | sort -V | tail -n 1)
  [ -d "/etc/postgresql/$cluster/main" ] || pg_createcluster "$cluster" main
  pg_ctlcluster --skip-systemctl-redirect "$cluster" main start
  for _ in $(seq 1 30); do pg_isready -q -h 127.0.0.1 -p 5432 && break; sleep 1; done
fi
# The tests connect as user postgres over 127.0.0.1 without a password.
if ! psql -h 127.0.0.1 -p 5432 -U postgres -w -Atqc 'SELECT 1' >/dev/null 2>&1; then
  echo "setup: trusting user postgres on 127.0.0.1 (test machine only)"
  hba=$(runuser -u postgres -- psql -Atqc 'SHOW hba_file')
  sed -i '1i host all postgres 127.0.0.1/32 trust' "$hba"
  runuser -u postgres -- psql -Atqc 'SELECT pg_reload_conf()' >/dev/null
fi

if ! cargo nextest --version >/dev/null 2>&1; then
  echo "setup: installing cargo-nextest"
  cargo install --locked cargo-nextest
fi

# The venv (Helm chart tests, API fuzzing, the client-process benchmark's
# smoke test) is rebuilt whenever the pinned requirements change.
requirements=(tests/helm/requirements.txt tests/fuzz/requirements.txt tests/bench/requirements.txt)
if ! cat "${requirements[@]}" | cmp -s - .venv/requirements.txt 2>/dev/null; then
  echo "setup: creating .venv"
  rm -rf .venv
  python3 -m venv .venv
  for r in "${requirements[@]}"; do
    .venv/bin/pip install -q --disable-pip-version-check -r "$r"
  done
  cat "${requirements[@]}" > .venv/requirements.txt
fi
