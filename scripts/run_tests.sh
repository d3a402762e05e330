#!/usr/bin/env bash
# `make test`: the whole suite in two phases, on a machine of any size.
# 1. The engine's tests (tests/batching: CPU-bound, deterministic, no timing) as two pytest sessions side by
#    side, each with one torch thread (a tiny model's products gain little from a second thread; two
#    sessions keep both cores busy). Each session has its own database and Redis prefix (tests/conftest.py).
# 2. Everything else as two pytest-xdist workers, a test file at a time each (`--dist loadfile`: a file's
#    worker stacks and servers stay in one session), one torch thread per process. The service tests mostly
#    wait on workers, leases and outages; one torch thread keeps a test's offline engine from spinning
#    against the workers' (two OpenMP threads on a busy 2-core machine ran 9x slower than one).
# Exit status: non-zero if any session failed; every session's summary is printed.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTEST=${PYTEST:-.venv/bin/pytest}
SHARDS=${GENQ_ENGINE_SHARDS:-2}
logs=$(mktemp -d)
pids=()
for ((i = 0; i < SHARDS; i++)); do
    GENQ_TEST_SHARD="$i/$SHARDS" OMP_NUM_THREADS=1 "$PYTEST" -q tests/batching "$@" > "$logs/engine-$i.log" 2>&1 &
    pids+=($!)
done
status=0
for ((i = 0; i < SHARDS; i++)); do
    wait "${pids[$i]}" || status=1
    echo "=== tests/batching, shard $i of $SHARDS ==="
    cat "$logs/engine-$i.log"
done
OMP_NUM_THREADS=1 "$PYTEST" -q -n "${GENQ_SERVICE_WORKERS:-2}" --dist loadfile tests --ignore=tests/batching "$@" || status=1
rm -rf "$logs"
exit $status
