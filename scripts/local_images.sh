#!/usr/bin/env bash
# The images docker-compose.yml needs, built from Debian bookworm's packages alone, for a host whose Docker
# cannot pull from a registry (PyPI and deb.debian.org reachable, Docker Hub not). Tags (kept for reuse; an
# image already there is not built again, GENQ_LOCAL_REBUILD=1 rebuilds):
#   genq-local/debian:bookworm    debootstrap --variant=minbase bookworm, then `docker import`
#   genq-local/python:3.11        + Debian's python3 (3.11) in a venv on PATH: the Dockerfile's BASE_IMAGE
#   genq-local/postgres:15        stand-in for postgres:16 (Debian's postgresql-15, the same env contract)
#   genq-local/redis:7            stand-in for redis:7 (Debian's redis 7.0)
#   genq-local/prometheus:2       stand-in for prom/prometheus (Debian's prometheus 2.42)
# deploy/compose/local-images.yml points compose at them (Grafana is not packaged by Debian: it stays off).
# Needs root (debootstrap) and a Docker daemon.   bash scripts/local_images.sh
set -euo pipefail
cd "$(dirname "$0")/.."
LOCAL=deploy/compose/local
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}

have() { [ -z "${GENQ_LOCAL_REBUILD:-}" ] && docker image inspect "$1" >/dev/null 2>&1; }

if have genq-local/debian:bookworm; then
    echo "genq-local/debian:bookworm: already here"
else
    command -v debootstrap >/dev/null || { echo "debootstrap is not installed (apt-get install debootstrap)"; exit 1; }
    rootfs=$(mktemp -d /var/tmp/genq-rootfs.XXXXXX)
    trap 'rm -rf "$rootfs"' EXIT
    debootstrap --variant=minbase bookworm "$rootfs" "$MIRROR"
    echo "deb $MIRROR bookworm main" > "$rootfs/etc/apt/sources.list"
    echo "deb $MIRROR bookworm-updates main" >> "$rootfs/etc/apt/sources.list"
    echo "deb http://deb.debian.org/debian-security bookworm-security main" >> "$rootfs/etc/apt/sources.list"
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
    # the certificate authorities this host adds to Debian's (e.g. a TLS-intercepting proxy's, without which
    # pip in a build cannot reach PyPI): the python image's ca-certificates puts them in the system bundle
    if compgen -G "/usr/local/share/ca-certificates/*.crt" >/dev/null; then
        mkdir -p "$rootfs/usr/local/share/ca-certificates"
        cp /usr/local/share/ca-certificates/*.crt "$rootfs/usr/local/share/ca-certificates/"
    fi
    tar -C "$rootfs" -c . | docker import \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'CMD ["bash"]' - genq-local/debian:bookworm
    rm -rf "$rootfs"
    trap - EXIT
fi

for pair in python:3.11 postgres:15 redis:7 prometheus:2; do
    name=${pair%%:*}
    if have "genq-local/$pair"; then
        echo "genq-local/$pair: already here"
    else
        docker build -q -t "genq-local/$pair" -f "$LOCAL/$name.Dockerfile" "$LOCAL"
    fi
done
docker image ls 'genq-local/*'
