#!/usr/bin/env bash
# Development helper: assemble an importable cyformer in DIR from the last
# compiled build (build/lib.*) overlaid with the working tree's Python files,
# so Python-only changes can be tested without recompiling the kernels.
#   scripts/devlib.sh /tmp/cy && PYTHONPATH=/tmp/cy CYFORMER_TEST_SOURCE=1 python -m pytest tests
# (Build first with: CYFORMER_ISA=v3 python setup.py build)
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:?usage: scripts/devlib.sh DIR}
LIB=$(ls -d build/lib.*/ | head -1)
rm -rf "$DIR" && mkdir -p "$DIR"
cp -r "$LIB/cyformer" "$DIR/"
(cd cyformer && find . -name '*.py' -not -path '*/__pycache__/*' -exec cp --parents {} "$DIR/cyformer/" \;)
cp -r cyformer/data "$DIR/cyformer/" 2>/dev/null || true
