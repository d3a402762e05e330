#!/usr/bin/env bash
# `make test`: the whole suite in two phases, each as two pytest-xdist sessions, one torch thread per process.
# 1. The service tests (everything but tests/batching), a test file at a time each (`--dist loadfile`: a file's
#    worker stacks and servers stay in one session). They mostly wait on workers, leases and outages: on a 2-core
#    machine the phase keeps the cores about 60% busy.
# 2. The engine's tests (tests/batching: CPU-bound, deterministic, no timing), test by test (`--dist load`), run
#    beside the service tests at the lowest CPU priority (`nice -n 19`): they take the CPU the service tests leave
#    idle and almost none they want (the kernel gives a niced process ~1.5% of a core another process wants), so
#    the service tests' timings are as without them, and what the engine phase has left runs at full speed once
#    the service tests end. Its output is printed after the service tests'.
# One torch thread a process keeps a test's offline engine from spinning against the workers' (two OpenMP threads
# on a busy 2-core machine ran 9x slower than one); the workers default to cores - 1 threads.
# Each session has its own database and Redis prefix (tests/conftest.py). GENQ_TEST_WORKERS: sessions a phase.
# Each phase prints its 15 slowest tests (CI must stay under 30 minutes on a 2-core machine) and writes every
# test's time to test-results/<phase>.xml (JUnit XML: what a CI page shows, and what to read when cutting time).
# Exit status: non-zero if either phase failed.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTEST=${PYTEST:-.venv/bin/pytest}
WORKERS=${GENQ_TEST_WORKERS:-2}
export OMP_NUM_THREADS=1
mkdir -p test-results
engine_log=test-results/engine.log
echo "=== the engine's tests (tests/batching): started beside the service tests, niced; output in $engine_log ==="
# A niced test's wall time says little of its cost (it waits whenever the service tests want both cores), so its
# hang timeout is twice pyproject's 600 s
nice -n 19 "$PYTEST" -q --durations=15 -n "$WORKERS" --dist load --timeout=1200 \
    --junitxml=test-results/engine.xml tests/batching "$@" > "$engine_log" 2>&1 &
engine=$!
# a stopped `make test` stops the engine's tests too
trap 'kill "$engine" 2> /dev/null' EXIT
echo "=== the service tests (everything else) ==="
service_status=0
"$PYTEST" -q --durations=15 -n "$WORKERS" --dist loadfile --junitxml=test-results/service.xml \
    tests --ignore=tests/batching "$@" || service_status=1
echo "=== the engine's tests (tests/batching): $( kill -0 "$engine" 2> /dev/null && echo "still running" || echo done) ==="
engine_status=0
wait "$engine" || engine_status=1
trap - EXIT
cat "$engine_log"
echo "=== service tests: $([ $service_status = 0 ] && echo passed || echo FAILED); engine tests: $([ $engine_status = 0 ] && echo passed || echo FAILED) ==="
exit $((service_status | engine_status))
