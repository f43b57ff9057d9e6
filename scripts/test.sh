#!/usr/bin/env bash
# The whole test suite: installs what is missing, checks formatting and
# lints, runs the Rust tests (real sidecar processes over real HTTP), a short
# schemathesis run against the API, the Helm chart tests, and a smoke run of
# the client-process benchmark (scripts/client_procs.py, debug sidecar).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
cargo fmt --all --check
cargo clippy --workspace --all-targets --locked -- -D warnings
cargo build --workspace --locked --bins
cargo nextest run --workspace --locked --profile ci
scripts/fuzz-api.sh 100
.venv/bin/pytest tests/helm tests/bench -q
