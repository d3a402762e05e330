#!/usr/bin/env bash
# docker compose, tried as a new user would: build and start the CPU profile with .env.example as shipped,
# then README's flow against it (a key, a job, its result), the probes and Prometheus' targets; everything
# is removed at the end (containers, volumes; built images are kept). It takes minutes (the first build of
# genq's images most of them). Where no registry is reachable, it runs on the images scripts/local_images.sh
# builds from Debian's packages (deploy/compose/local-images.yml: Grafana left out) and installs torch from a
# CPU wheel on this host (TORCH_WHEEL_DIR, default /opt/wheels), served to the build over HTTP.
# Compose v2 (`docker compose`) where present, else docker-compose 1.29 (Debian's), which reads neither the
# top-level `name` nor env_file's `required`: it gets a copy of docker-compose.yml without them, its
# containers reading the env file below. Without a daemon, Compose, or the images, it prints
# "skipped: <reason>" and exits 0; a failure exits 1.
#
#   bash scripts/compose_smoke.sh          # project genq-smoke, API on :18000 (SMOKE_API_PORT)
set -euo pipefail
cd "$(dirname "$0")/.."

skip() { echo "skipped: $*"; exit 0; }
fail() { echo "FAILED: $*"; compose logs --tail 60 || true; exit 1; }
command -v docker >/dev/null || skip "no docker CLI"
docker info >/dev/null 2>&1 || skip "no Docker daemon answers (docker info failed)"
if docker compose version >/dev/null 2>&1; then
    COMPOSE=(docker compose) V=2
elif docker-compose version >/dev/null 2>&1; then
    COMPOSE=(docker-compose) V=1
else
    skip "neither Compose v2 (docker compose) nor docker-compose is installed"
fi
echo "compose: $("${COMPOSE[@]}" version | head -n 1)"

START=$(date +%s)
PORT=${SMOKE_API_PORT:-18000}
WORK=$(mktemp -d)
ENV_FILE=$WORK/env
FILES=(-f docker-compose.yml)
SERVER_PID=
set_env() { sed -i "/^$1=/d" "$ENV_FILE"; echo "$1=$2" >> "$ENV_FILE"; }
compose() { "${COMPOSE[@]}" -p genq-smoke --project-directory . --env-file "$ENV_FILE" "${FILES[@]}" "$@"; }
cleanup() {
    compose --profile cpu down -v --remove-orphans >/dev/null 2>&1 || true
    [ -z "$SERVER_PID" ] || kill "$SERVER_PID" 2>/dev/null || true
    rm -rf "$WORK"
}
trap cleanup EXIT
# .env.example as shipped, on ports of its own so a running stack is left alone
sed -e "s/^API_PORT=.*/API_PORT=$PORT/" -e "s/^FLOWER_PORT=.*/FLOWER_PORT=15555/" \
    -e "s/^PROMETHEUS_PORT=.*/PROMETHEUS_PORT=19090/" -e "s/^GRAFANA_PORT=.*/GRAFANA_PORT=13000/" \
    .env.example > "$ENV_FILE"

# the services' images: pulled, or else the stand-ins of scripts/local_images.sh
images() { python3 -c 'import sys, yaml; print(*sorted({s["image"] for s in yaml.safe_load(open(sys.argv[1]))["services"].values() if "image" in s and "build" not in s}))' "$1"; }
present() { docker image inspect "$1" >/dev/null 2>&1 || docker pull -q "$1" >/dev/null 2>&1; }
LOCAL_IMAGES=${SMOKE_LOCAL_IMAGES:-}
if [ -z "$LOCAL_IMAGES" ]; then
    LOCAL_IMAGES=0
    for image in python:3.11-slim $(images docker-compose.yml); do present "$image" || LOCAL_IMAGES=1; done
fi
if [ "$LOCAL_IMAGES" = 1 ]; then
    for image in genq-local/python:3.11 $(images deploy/compose/local-images.yml); do
        present "$image" || skip "image $image is not here and no registry is reachable: run scripts/local_images.sh"
    done
    FILES+=(-f deploy/compose/local-images.yml)
    set_env BASE_IMAGE genq-local/python:3.11
    echo "images: local stand-ins (deploy/compose/local-images.yml; Grafana left out: Debian does not package it)"
fi

# torch: the CPU index, or else a CPU wheel on this host served to the build (never PyPI's torch, a CUDA build)
if ! curl -fsS -m 10 -o /dev/null https://download.pytorch.org/whl/cpu/torch/ 2>/dev/null; then
    WHEELS=${TORCH_WHEEL_DIR:-/opt/wheels}
    ls "$WHEELS"/torch-*+cpu-cp311-*.whl >/dev/null 2>&1 \
        || skip "download.pytorch.org does not answer and $WHEELS has no CPU torch wheel for Python 3.11"
    # the host's address on Docker's default bridge, where `docker build`'s containers run
    GATEWAY=$(docker network inspect bridge -f '{{range .IPAM.Config}}{{.Gateway}}{{end}}')
    [ -n "$GATEWAY" ] || GATEWAY=$(ip -4 -o addr show docker0 2>/dev/null | awk '{print $4}' | cut -d/ -f1)
    [ -n "$GATEWAY" ] || skip "the host's address on Docker's bridge network is unknown (to serve the torch wheel)"
    WHEEL_PORT=${SMOKE_WHEEL_PORT:-18765}
    python3 -m http.server --bind "$GATEWAY" --directory "$WHEELS" "$WHEEL_PORT" >/dev/null 2>&1 &
    SERVER_PID=$!
    set_env TORCH_FIND_LINKS "http://$GATEWAY:$WHEEL_PORT/"
    echo "torch: the CPU wheel in $WHEELS, served on $GATEWAY:$WHEEL_PORT"
fi

if [ "$V" = 1 ]; then  # a copy docker-compose 1.29 reads (no top-level name, env_file a plain path)
    python3 - docker-compose.yml "$ENV_FILE" "$WORK/docker-compose.v1.yml" <<'PY'
import sys, yaml
source, env_file, target = sys.argv[1:]
document = yaml.safe_load(open(source))
document.pop("name", None)
for service in document["services"].values():
    if "env_file" in service:
        service["env_file"] = [env_file]
yaml.safe_dump(document, open(target, "w"), sort_keys=False)
PY
    FILES[1]=$WORK/docker-compose.v1.yml
fi

compose config --quiet
if [ "$V" = 2 ]; then
    compose --profile cpu up --build --detach --wait --wait-timeout 900
else  # no --wait: build, start, then poll each container's health
    compose --profile cpu build
    echo "built in $(( $(date +%s) - START )) s"
    compose --profile cpu up --detach
    deadline=$(( $(date +%s) + 900 ))
    while :; do
        waiting=""
        for id in $(compose --profile cpu ps -q); do
            read -r name state health code < <(docker inspect -f \
                '{{.Name}} {{.State.Status}} {{if .State.Health}}{{.State.Health.Status}}{{else}}none{{end}} {{.State.ExitCode}}' "$id")
            case "$state/$health" in
                running/healthy | running/none) ;;
                exited/none) [ "$code" = 0 ] || fail "$name exited with $code" ;;
                */unhealthy) fail "$name is unhealthy" ;;
                *) waiting="$waiting $name($state/$health)" ;;
            esac
        done
        [ -z "$waiting" ] && break
        [ "$(date +%s)" -lt "$deadline" ] || fail "not healthy after 900 s:$waiting"
        sleep 5
    done
fi
echo "healthy in $(( $(date +%s) - START )) s"
API="http://127.0.0.1:$PORT"
curl -fsS "$API/livez" >/dev/null && curl -fsS "$API/readyz" >/dev/null || fail "the probes"

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
[ "$STATUS" = succeeded ] || fail "job $JOB is $STATUS"

# Prometheus scraped the API and the worker (their targets are up)
UP=""
for _ in $(seq 12); do
    UP=$(curl -fsS "http://127.0.0.1:19090/api/v1/query?query=up" \
         | python3 -c 'import json,sys; print(sorted({r["metric"]["job"] for r in json.load(sys.stdin)["data"]["result"] if r["value"][1] == "1"}))')
    [ "$UP" = "['genq-api', 'genq-worker']" ] && break
    sleep 5
done
[ "$UP" = "['genq-api', 'genq-worker']" ] || fail "Prometheus targets up: $UP"
echo "compose smoke passed ($("${COMPOSE[@]}" version --short 2>/dev/null || echo "v$V"), $(( $(date +%s) - START )) s): job $JOB succeeded; Prometheus scrapes $UP"

# stopped as a redeploy would: each service before those it depends on, within its stop_grace_period
# (exit code 137: Docker killed it when its grace ran out)
STOP=$(date +%s)
compose --profile cpu stop >/dev/null 2>&1
echo "stopped in $(( $(date +%s) - STOP )) s; exit codes:" \
    $(for id in $(compose --profile cpu ps -q); do docker inspect -f '{{.Name}}={{.State.ExitCode}}' "$id"; done | sed 's|^/genq-smoke[_-]||')
