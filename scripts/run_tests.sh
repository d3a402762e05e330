#!/usr/bin/env bash
# `make test`: the whole suite in two phases, each as two pytest-xdist sessions, one torch thread per process.
# 1. The engine's tests (tests/batching: CPU-bound, deterministic, no timing), test by test (`--dist load`): two
#    sessions keep both cores busy, and a tiny model's products gain little from a second thread.
# 2. Everything else, a test file at a time each (`--dist loadfile`: a file's worker stacks and servers stay in
#    one session). The service tests mostly wait on workers, leases and outages, so two sessions roughly halve
#    the phase. One torch thread keeps a test's offline engine from spinning against the workers' (two OpenMP
#    threads on a busy 2-core machine ran 9x slower than one); the workers default to cores - 1 threads.
# Each session has its own database and Redis prefix (tests/conftest.py). GENQ_TEST_WORKERS: sessions a phase.
# Each phase prints its 15 slowest tests (CI must stay under 30 minutes on a 2-core machine) and writes every
# test's time to test-results/<phase>.xml (JUnit XML: what a CI page shows, and what to read when cutting time).
# Exit status: non-zero if either phase failed.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTEST=${PYTEST:-.venv/bin/pytest}
WORKERS=${GENQ_TEST_WORKERS:-2}
export OMP_NUM_THREADS=1
status=0
mkdir -p test-results
echo "=== the engine's tests (tests/batching) ==="
"$PYTEST" -q --durations=15 -n "$WORKERS" --dist load --junitxml=test-results/engine.xml tests/batching "$@" || status=1
echo "=== the service tests (everything else) ==="
"$PYTEST" -q --durations=15 -n "$WORKERS" --dist loadfile --junitxml=test-results/service.xml tests --ignore=tests/batching "$@" || status=1
exit $status
