#!/usr/bin/env bash
# The whole test suite: installs what is missing, checks formatting and
# lints, runs the Rust tests (real sidecar processes over real HTTP) and the
# Helm chart tests.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
cargo fmt --check
cargo clippy --all-targets --locked -- -D warnings
cargo build --locked --bins
cargo nextest run --locked --profile ci
if [ -d tests/helm ]; then
  .venv/bin/pytest tests/helm -q
else
  echo "test: no tests/helm in this checkout; skipping the Helm chart tests"
fi
