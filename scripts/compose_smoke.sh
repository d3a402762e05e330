#!/usr/bin/env bash
# docker compose, tried as a new user would: build and start the CPU profile with .env.example as shipped,
# then README's flow against it (a key, a job, its result), the probes and Prometheus' targets; everything
# is removed at the end (containers, volumes). Needs a Docker daemon, Compose v2 and the base images
# (python:3.11-slim and the images docker-compose.yml names) or a registry to pull them from.
# Elsewhere it prints "skipped: <reason>" and exits 0; a failure exits 1.
#
#   bash scripts/compose_smoke.sh          # project genq-smoke, API on :18000 (SMOKE_API_PORT)
set -euo pipefail
cd "$(dirname "$0")/.."

skip() { echo "skipped: $*"; exit 0; }
command -v docker >/dev/null || skip "no docker CLI"
docker info >/dev/null 2>&1 || skip "no Docker daemon answers (docker info failed)"
docker compose version >/dev/null 2>&1 || skip "no Compose v2 (the docker compose plugin is not installed)"

PORT=${SMOKE_API_PORT:-18000}
ENV_FILE=$(mktemp)
trap 'docker compose -p genq-smoke --env-file "$ENV_FILE" down -v --remove-orphans >/dev/null 2>&1 || true; rm -f "$ENV_FILE"' EXIT
# .env.example as shipped, on ports of its own so a running stack is left alone
sed -e "s/^API_PORT=.*/API_PORT=$PORT/" -e "s/^FLOWER_PORT=.*/FLOWER_PORT=15555/" \
    -e "s/^PROMETHEUS_PORT=.*/PROMETHEUS_PORT=19090/" -e "s/^GRAFANA_PORT=.*/GRAFANA_PORT=13000/" \
    .env.example > "$ENV_FILE"
compose() { docker compose -p genq-smoke --env-file "$ENV_FILE" "$@"; }

# the base image and the services' images (genq's own are built from the Dockerfile)
for image in python:3.11-slim $(compose --profile cpu config --images | grep -v '^genq:'); do
    docker image inspect "$image" >/dev/null 2>&1 || docker pull -q "$image" >/dev/null 2>&1 \
        || skip "image $image is not here and cannot be pulled (no registry reachable)"
done

compose config --quiet
compose --profile cpu up --build --detach --wait --wait-timeout 900
API="http://127.0.0.1:$PORT"
curl -fsS "$API/livez" >/dev/null && curl -fsS "$API/readyz" >/dev/null

KEY=$(compose exec -T api flask --app webapi keys create smoke | tail -n 1)
JOB=$(curl -fsS -X POST "$API/jobs" -H "Authorization: Bearer $KEY" -H "Content-Type: application/json" \
      -d '{"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0, "priority": 0}' \
      | python3 -c 'import json,sys; print(json.load(sys.stdin)["id"])')
STATUS=""
for _ in $(seq 20); do
    STATUS=$(curl -fsS "$API/jobs/$JOB?wait=30" -H "Authorization: Bearer $KEY" \
             | python3 -c 'import json,sys; print(json.load(sys.stdin)["status"])')
    [ "$STATUS" = succeeded ] && break
done
[ "$STATUS" = succeeded ] || { echo "FAILED: job $JOB is $STATUS"; compose logs --tail 100; exit 1; }

# Prometheus scraped the API and the worker (their targets are up)
sleep 20
UP=$(curl -fsS "http://127.0.0.1:19090/api/v1/query?query=up" \
     | python3 -c 'import json,sys; print(sorted({r["metric"]["job"] for r in json.load(sys.stdin)["data"]["result"] if r["value"][1] == "1"}))')
[ "$UP" = "['genq-api', 'genq-worker']" ] || { echo "FAILED: Prometheus targets up: $UP"; exit 1; }
echo "compose smoke passed: job $JOB succeeded; Prometheus scrapes $UP"
