#!/bin/sh
# Run the Helm chart tests; creates the virtual environment on first use.
#   tests/helm/run.sh [pytest args…]
set -eu
repo=$(cd "$(dirname "$0")/../.." && pwd)
venv="$repo/.venv"
if [ ! -x "$venv/bin/pytest" ] || ! "$venv/bin/python" -c 'import helm_python, kubernetes_validate, yaml' 2>/dev/null; then
    python3 -m venv "$venv"
    "$venv/bin/pip" install --quiet -r "$repo/tests/helm/requirements.txt"
fi
cd "$repo"
exec "$venv/bin/pytest" tests/helm -q "$@"
