"""One way from REDIS_URL to Redis for every component: a redis-py client, Celery's broker settings and
Flask-Limiter's storage, for each kind of URL genq accepts.

    redis://[[user]:password@]host:6379/0           TCP
    rediss://[[user]:password@]host:6380/0          TLS (redis-py's query options: ?ssl_ca_certs=..., ...)
    unix://[[user]:password@]/path/redis.sock?db=0  a Unix socket
    redis+sentinel://[[user]:password@]host:26379[,host2:26379...]/mymaster[/0]
                                                    the master of service `mymaster` as Sentinel names it:
                                                    found through the sentinels, and found again after a
                                                    failover. The password is the master's (and replicas');
                                                    the sentinels' own is ?sentinel_password=...
    rediss+sentinel://...                           the same over TLS, to the sentinels and the master

redis-py, kombu (Celery) and limits (Flask-Limiter) each spell these differently: `unix://` is kombu's
`redis+socket://` and limits' `redis+unix://`, a Sentinel service is kombu's `sentinel://h1;sentinel://h2` plus
a `master_name` transport option, and limits' `redis+sentinel://h1,h2/service` with the database as an option.
The functions below translate, so that a URL one component accepts works in all of them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, quote, unquote, urlsplit

import redis
from redis.sentinel import Sentinel, SentinelConnectionPool

SENTINEL_SCHEMES = {"redis+sentinel": False, "rediss+sentinel": True}  # scheme -> TLS

try:  # redis-py 7 looks its own version up in the installed packages for each new connection unless told it:
    # 384 -> 45 us a connection object, 987 -> 180 us a connection opened (a burst of requests opens ~1 a request)
    from redis.driver_info import DriverInfo

    DRIVER_OPTIONS: dict[str, Any] = {"driver_info": DriverInfo(lib_version=redis.__version__)}
except ImportError:  # redis-py 5 and 6 read it once, at import
    DRIVER_OPTIONS = {}


@dataclass(frozen=True, slots=True)
class SentinelService:
    """A `redis+sentinel://` URL, parsed."""

    sentinels: tuple[tuple[str, int], ...]
    service: str
    db: int
    username: str | None
    password: str | None
    sentinel_password: str | None
    ssl: bool


def sentinel_service(url: str) -> SentinelService | None:
    """The Sentinel service a `redis+sentinel://` / `rediss+sentinel://` URL names; None for any other URL."""
    scheme, _, rest = url.partition("://")
    if scheme not in SENTINEL_SCHEMES:
        return None
    credentials, _, hosts = rest.rpartition("@") if "@" in rest.split("/", 1)[0] else ("", "", rest)
    hosts, _, path = hosts.partition("/")
    path, _, query = path.partition("?")
    username, _, password = credentials.partition(":") if credentials else ("", "", "")
    sentinels = []
    for host in hosts.split(","):
        name, _, port = host.rpartition(":") if ":" in host else (host, "", "26379")
        if not name:
            raise ValueError(f"REDIS_URL: no sentinel host in {host!r}")
        sentinels.append((name.strip("[]"), int(port)))
    service, _, db = path.strip("/").partition("/")
    if not service:
        raise ValueError(
            "REDIS_URL: a Sentinel URL names its service: redis+sentinel://host:26379/mymaster/0"
        )
    options = dict(parse_qsl(query))
    unknown = set(options) - {"sentinel_password"}
    if unknown:
        raise ValueError(f"REDIS_URL: unknown Sentinel URL options {sorted(unknown)}")
    return SentinelService(
        sentinels=tuple(sentinels),
        service=service,
        db=int(db or 0),
        username=unquote(username) or None,
        password=unquote(password) or None,
        sentinel_password=options.get("sentinel_password"),
        ssl=SENTINEL_SCHEMES[scheme],
    )


class SentinelBlockingConnectionPool(SentinelConnectionPool, redis.BlockingConnectionPool):
    """The master's connections, found through Sentinel, at most `max_connections`, callers waiting for one
    (redis.BlockingConnectionPool's behaviour; redis-py's Sentinel pool opens one per concurrent caller)."""


def redis_client(
    url: str,
    *,
    timeout: float | None = None,
    connect_timeout: float | None = None,
    max_connections: int | None = None,
    pool_timeout: float | None = None,
) -> redis.Redis:
    """A redis-py client for REDIS_URL: `timeout` seconds for each reply and, unless `connect_timeout` says
    otherwise, to connect (None: no limit); with `max_connections`, callers share at most that many
    connections and wait for one up to `pool_timeout` seconds (None: `timeout`)."""
    options: dict[str, Any] = {
        "socket_timeout": timeout,
        "socket_connect_timeout": timeout if connect_timeout is None else connect_timeout,
        **DRIVER_OPTIONS,
    }
    wait = timeout if pool_timeout is None else pool_timeout
    service = sentinel_service(url)
    if service is None:
        if max_connections is None:
            return redis.Redis.from_url(url, **options)
        pool = redis.BlockingConnectionPool.from_url(
            url, max_connections=max_connections, timeout=wait, **options
        )
        return redis.Redis(connection_pool=pool)
    sentinels = Sentinel(
        list(service.sentinels),
        sentinel_kwargs={"password": service.sentinel_password, "ssl": service.ssl, **options},
    )
    master: dict[str, Any] = {
        "db": service.db,
        "username": service.username,
        "password": service.password,
        "ssl": service.ssl,
        **options,
    }
    if max_connections is None:
        return sentinels.master_for(service.service, **master)
    return sentinels.master_for(
        service.service,
        connection_pool_class=SentinelBlockingConnectionPool,
        max_connections=max_connections,
        timeout=wait,
        **master,
    )


def celery_broker(url: str) -> tuple[str, dict[str, Any]]:
    """(broker_url, broker_transport_options to add) for Celery's Redis transport (kombu)."""
    service = sentinel_service(url)
    if service is not None:
        auth = _userinfo(service.username, service.password)
        hosts = ";".join(f"sentinel://{auth}{host}:{port}/{service.db}" for host, port in service.sentinels)
        options: dict[str, Any] = {"master_name": service.service}
        sentinel_kwargs = {
            k: v for k, v in {"password": service.sentinel_password, "ssl": service.ssl or None}.items() if v
        }
        if sentinel_kwargs:
            options["sentinel_kwargs"] = sentinel_kwargs
        return hosts, options
    parts = urlsplit(url)
    if parts.scheme == "unix":  # kombu: redis+socket:///path?virtual_host=N
        query = dict(parse_qsl(parts.query))
        db = query.pop("db", "0")
        auth = _userinfo(parts.username, parts.password)
        rest = "&".join(f"{k}={quote(v)}" for k, v in query.items())
        return f"redis+socket://{auth}{parts.path}?virtual_host={db}" + (f"&{rest}" if rest else ""), {}
    return url, {}


def limiter_storage(url: str) -> tuple[str, dict[str, Any]]:
    """(storage_uri, storage_options) for Flask-Limiter (the limits package)."""
    service = sentinel_service(url)
    if service is not None:
        auth = _userinfo(service.username, service.password)
        hosts = ",".join(f"{host}:{port}" for host, port in service.sentinels)
        options: dict[str, Any] = {
            "db": service.db,
            "use_replicas": False,  # counts read where they are written
            # limits gives the sentinels the URL's password unless told: theirs is sentinel_password
            "sentinel_kwargs": {
                "password": service.sentinel_password,
                **({"ssl": True} if service.ssl else {}),
            },
        }
        if service.ssl:
            options["ssl"] = True
        return f"redis+sentinel://{auth}{hosts}/{service.service}", options
    if url.startswith("unix://"):
        return "redis+unix://" + url[len("unix://") :], dict(DRIVER_OPTIONS)
    return url, dict(DRIVER_OPTIONS)  # (limits hands its options to redis.from_url)


def _userinfo(username: str | None, password: str | None) -> str:
    if not username and not password:
        return ""
    return f"{quote(username or '', safe='')}:{quote(password or '', safe='')}@"


def eviction_policy(client: redis.Redis) -> str | None:
    """Redis' maxmemory-policy, None when the server does not say (CONFIG renamed or refused, as managed
    Redis services do, or Redis down). genq needs `noeviction`: an evicted queue list loses its jobs' messages
    until the reconciler sends them again, and an evicted key of a job's events or of a rate limit is lost."""
    try:
        reply: dict = client.config_get("maxmemory-policy")  # type: ignore[assignment]
    except redis.RedisError:
        return None
    return reply.get("maxmemory-policy") or None


def warn_unless_noeviction(url: str, log: logging.Logger) -> str | None:
    """Log a warning when REDIS_URL's server may evict keys (maxmemory-policy other than noeviction); a
    server that does not tell is only noted. Returns the policy. Every process calls it when it starts."""
    client = redis_client(url, timeout=2)
    try:
        policy = eviction_policy(client)
    finally:
        client.close()
    if policy is None:
        log.info(
            "Redis' maxmemory-policy not checked (CONFIG GET refused or Redis not answering): it must be noeviction"
        )
    elif policy != "noeviction":
        log.warning(
            "Redis' maxmemory-policy is %s: under memory pressure it drops keys (queued jobs' messages, token "
            "events, rate limits); set maxmemory-policy noeviction",
            policy,
        )
    return policy
