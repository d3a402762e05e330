#!/usr/bin/env bash
# Start local Postgres and Redis if they are not answering (CI and fresh machines).
set -euo pipefail
if ! pg_isready -q -h 127.0.0.1 -p 5432 2>/dev/null; then
    echo "starting postgres"
    pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql)" main start
    for _ in $(seq 30); do pg_isready -q -h 127.0.0.1 -p 5432 && break; sleep 1; done
fi
if ! redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1; then
    echo "starting redis"
    mkdir -p /var/lib/redis /var/log/redis
    redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" --appendonly no \
        --dir /var/lib/redis --logfile /var/log/redis/ci.log
    for _ in $(seq 30); do redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1 && break; sleep 1; done
fi
# Debian's pgbouncer (tests/deployment/test_pgbouncer.py starts its own, in transaction mode) and
# redis-sentinel (tests/contract/test_redis_client.py starts its own): installed once, no service started here
missing=()
[ -x /usr/sbin/pgbouncer ] || missing+=(pgbouncer)
command -v redis-sentinel >/dev/null || missing+=(redis-sentinel)
command -v openssl >/dev/null || missing+=(openssl)  # the same test's TLS certificates
# Debian's chromium and its chromedriver: the admin page and /docs in a real headless browser
# (tests/webapi/test_admin.py through selenium, tests/webapi/test_docs.py)
command -v chromium >/dev/null || missing+=(chromium)
command -v chromedriver >/dev/null || missing+=(chromium-driver)
if [ ${#missing[@]} -gt 0 ]; then
    echo "installing ${missing[*]}"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}") >/dev/null
fi
