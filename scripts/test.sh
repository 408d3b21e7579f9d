#!/usr/bin/env bash
# Build the wheel, install it with the test dependencies into a fresh virtual
# environment, and run the test suite against the installed package (not the
# source tree).  Usage: scripts/test.sh [extra pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
VENV=${CYFORMER_TEST_VENV:-$ROOT/build/test-venv}

rm -rf "$VENV" dist
"$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --upgrade pip
# The release wheel (all x86-64 levels); build isolation fetches Cython/NumPy.
"$VENV/bin/python" -m pip wheel --quiet --no-deps --wheel-dir dist .
WHEEL=$(ls dist/cyformer-*.whl)
# torch is pinned to the CPU build in the [test] extra.
"$VENV/bin/python" -m pip install --quiet "${WHEEL}[test]"

# Run from outside the checkout so `import cyformer` finds the installed wheel.
cd "$VENV"
"$VENV/bin/python" -c "import cyformer, json; print(json.dumps(cyformer.build_info()))"
"$VENV/bin/python" -m pytest -p no:cacheprovider --rootdir "$ROOT" "$ROOT/tests" "$@"
