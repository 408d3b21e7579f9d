#!/usr/bin/env bash
# Build the wheel, install it with the test dependencies into a fresh virtual
# environment, and run the test suite against the installed package (not the
# source tree).  Usage: scripts/test.sh [extra pytest args for the main suite]
#
# Order: release wheel -> debug-build kernel tests -> benchmark smoke run ->
# the docs site (strict) ->
# the full suite against the release wheel (last, so its summary closes the log).
#
# What it costs: it replaces ./dist (the wheel it builds) and the virtual
# environment build/test-venv (CYFORMER_TEST_VENV to put it elsewhere), which
# takes about 2 GB because the [test] extra installs torch (CPU), transformers,
# Ray, datasets and TransformerLens from PyPI; the suite runs ~15-20 minutes
# on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
VENV=${CYFORMER_TEST_VENV:-$ROOT/build/test-venv}

echo "scripts/test.sh: replacing ./dist and $VENV (~2 GB: torch, transformers, Ray ... from PyPI)" >&2
rm -rf "$VENV" dist
"$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --upgrade pip
# The release wheel (all x86-64 levels); build isolation fetches Cython/NumPy.
"$VENV/bin/python" -m pip wheel --quiet --no-deps --wheel-dir dist .
WHEEL=$(ls dist/cyformer-*.whl)
# torch is pinned to the CPU build in the [test] extra; [bench] adds what
# bench/run.py needs (tqdm, threadpoolctl, matplotlib).
"$VENV/bin/python" -m pip install --quiet "${WHEEL}[test,bench]"

# Run from outside the checkout so `import cyformer` finds the installed wheel.
cd "$VENV"
"$VENV/bin/python" -c "import cyformer, json; print(json.dumps(cyformer.build_info()))"

# Debug build: the same kernels with bounds and wraparound checks on
# (CYFORMER_DEBUG=1, see setup.py), one ISA level to keep the build short, run
# against the kernel tests, the fused decode step's tests and the kernel fuzz
# properties, so an out-of-bounds
# index is an IndexError here instead of silent corruption.  It is built from
# a copy of the tree so that ./build keeps the release objects; afterwards the
# release wheel is put back.
DEBUG_SRC=$(mktemp -d)
BENCH_OUT=$(mktemp -d)
trap 'rm -rf "$DEBUG_SRC" "$BENCH_OUT"' EXIT
if git -C "$ROOT" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    # tracked and untracked-but-not-ignored files that exist (no build/, no dist/)
    (cd "$ROOT" && git ls-files -z --cached --others --exclude-standard \
        | while IFS= read -r -d '' f; do if [ -f "$f" ]; then printf '%s\0' "$f"; fi; done \
        | xargs -0 cp --parents -t "$DEBUG_SRC")
else
    tar -C "$ROOT" --exclude=./build --exclude=./dist -cf - . | tar -C "$DEBUG_SRC" -xf -
fi
(cd "$DEBUG_SRC" && CYFORMER_DEBUG=1 CYFORMER_ISA=v2 "$VENV/bin/python" -m pip wheel --quiet --no-deps \
    --wheel-dir "$DEBUG_SRC/dist" .)
"$VENV/bin/python" -m pip install --quiet --force-reinstall --no-deps "$DEBUG_SRC"/dist/cyformer-*.whl
"$VENV/bin/python" -c "import cyformer, sys; info = cyformer.build_info(); print('debug build:', info['isa']); sys.exit(not info['debug'])"
"$VENV/bin/python" -m pytest -p no:cacheprovider -q --rootdir "$ROOT" "$ROOT/tests/test_kernels.py" \
    "$ROOT/tests/test_fuzz.py" -k kernel
"$VENV/bin/python" -m pytest -p no:cacheprovider -q --rootdir "$ROOT" "$ROOT/tests/test_decode.py"
"$VENV/bin/python" -m pytest -p no:cacheprovider -q --rootdir "$ROOT" "$ROOT/tests/test_llama.py" \
    -k "logits_match or decode_steps"
"$VENV/bin/python" -m pip install --quiet --force-reinstall --no-deps "$ROOT/$WHEEL"

# The full suite below runs the best kernel level this CPU has; the kernel,
# format, decode-step and backend tests also run at every other level it can
# run (the levels differ in tile sizes and in which kernels each format has,
# so each has its own edge cases).
LEVELS=$("$VENV/bin/python" -c "import cyformer; i = cyformer.build_info()
print(' '.join(lv for lv in i['isa_levels_built'] if lv != i['isa'] and lv[1:].isdigit()
               and int(lv[1:]) <= i['cpu_x86_level']))")
for LV in $LEVELS; do
    echo "kernel level $LV:"
    CYFORMER_ISA=$LV "$VENV/bin/python" -m pytest -p no:cacheprovider -q --rootdir "$ROOT" \
        "$ROOT/tests/test_kernels.py" "$ROOT/tests/test_formats.py" "$ROOT/tests/test_decode.py" \
        "$ROOT/tests/test_backends.py"
    CYFORMER_ISA=$LV "$VENV/bin/python" -m pytest -p no:cacheprovider -q --rootdir "$ROOT" \
        "$ROOT/tests/test_llama.py" -k "logits_match or backends_agree or decode_steps"
done

# Static types of the public surface ([tool.mypy] in pyproject.toml names the files).
(cd "$ROOT" && "$VENV/bin/python" -m mypy)

# The benchmark, as a smoke test only (timings on a shared machine are not checked).
"$VENV/bin/python" "$ROOT/bench/run.py" --quick --out "$BENCH_OUT"

# The documentation site in strict mode (a warning or a broken reference fails
# it); its tutorials run against the release wheel.  Pages: build/site/.
"$VENV/bin/python" -m pip install --quiet "${ROOT}/${WHEEL}[docs]"
(cd "$ROOT" && NO_MKDOCS_2_WARNING=1 "$VENV/bin/mkdocs" build --strict --site-dir "$ROOT/build/site")

# The full suite against the release wheel.
"$VENV/bin/python" -m pytest -p no:cacheprovider --rootdir "$ROOT" "$ROOT/tests" "$@"
