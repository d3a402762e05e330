"""A small HTTP client of genq's API for genq-batch: retries what is worth retrying, and says at once when
the API does not answer (a connection refused or timed out is retried for UNREACHABLE_AFTER seconds, not
for minutes)."""

from __future__ import annotations

import threading
import time

import requests

RETRY_STATUSES = (429, 502, 503, 504)
CONNECT_TIMEOUT = 3.0  # seconds to open a connection: an API that takes longer is not answering
UNREACHABLE_AFTER = 5.0  # seconds of failed connections before the client says the API does not answer


class BatchError(Exception):
    """The input or the server's answer makes going on pointless (bad key, bad file, no API)."""


class Client:
    """genq's API at `url` with one key. One requests.Session per thread; `stopping` (Ctrl-C) makes every
    call waiting to retry give up at once. `answers` counts the calls answered, by method."""

    def __init__(self, url: str, key: str, timeout: float = 60.0, max_wait: float = 300.0):
        self.url = url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {key}"}
        self.timeout = timeout  # for the answer, once connected
        self.max_wait = max_wait  # give up on one call after retrying busy answers (429, 503) this long
        self.stopping = threading.Event()
        self.answers: dict[str, int] = {}  # calls answered, by method
        self.throttled = 0  # of them, answered 429
        self._local = threading.local()

    def request(self, method: str, path: str, **kwargs) -> requests.Response:
        """Send; retry connection errors (for UNREACHABLE_AFTER seconds), 429 and 5xx-unavailable answers
        (after their Retry-After, for `max_wait` seconds)."""
        started = time.monotonic()
        unreachable_since = None
        delay = 0.5
        headers = {**self.headers, **kwargs.pop("headers", {})}
        while True:
            try:
                r = self._session().request(
                    method,
                    self.url + path,
                    headers=headers,
                    timeout=(CONNECT_TIMEOUT, self.timeout),
                    **kwargs,
                )
                self.answers[method] = self.answers.get(method, 0) + 1
                self.throttled += r.status_code == 429
                unreachable_since = None
                if r.status_code not in RETRY_STATUSES:
                    return r
                wait = float(r.headers.get("Retry-After") or delay)
                if time.monotonic() + wait - started > self.max_wait:
                    return r
            except (requests.ConnectionError, requests.Timeout) as exc:
                now = time.monotonic()
                unreachable_since = unreachable_since or now
                if now + delay - unreachable_since > UNREACHABLE_AFTER:
                    raise BatchError(
                        f"the API at {self.url} does not answer ({method} {path}: {type(exc).__name__})"
                    ) from None
                wait = delay
            if self.stopping.wait(wait):
                raise BatchError("interrupted")
            delay = min(delay * 2, 5.0)

    def _session(self) -> requests.Session:
        if not hasattr(self._local, "session"):
            self._local.session = requests.Session()
        return self._local.session


def error_of(r: requests.Response) -> dict:
    """The API's {"code", "message"} of an error answer (or one made from its status and text)."""
    try:
        return r.json()["error"]
    except (ValueError, KeyError, TypeError):
        return {"code": f"http_{r.status_code}", "message": r.text[:500]}
