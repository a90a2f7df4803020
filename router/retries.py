"""A retried request keeps the arrival of its first send, for admission.

A client told 429 with a ``Retry-After`` sends the same request again after it (the openai
client does, twice by default, counting its attempts in ``x-stainless-retry-count``). To the
router that retry was a new request with a whole TTFT SLO ahead of it, yet its user has waited
since the first send: admitted on a prediction that it would make the SLO from now, it came
after the SLO from the first send. At 6 req/s on this CPU (``bench/admission.py``, 2026-12-06)
such retries were 15 of the 16 admitted requests that missed the SLO in one run.

``RefusedRequests`` remembers, for a while, when each request refused here was first sent (the
earliest send the router saw of it), keyed by a digest of its path, its API key and its body; a
request that says it is a retry (``x-stainless-retry-count`` of 1 or more) and matches one is
admitted against the deadline of that first send. A request that does not say so is new even
when its body matches: two users may send the same prompt.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable

RETRY_COUNT_HEADER = "x-stainless-retry-count"


def retry_key(path: str, api_key: str, body: bytes) -> bytes:
    """What identifies a request's retries: the same endpoint, key and bytes."""
    digest = hashlib.sha256()
    for part in (path.encode(), api_key.encode(), body):
        digest.update(len(part).to_bytes(8, "little"))
        digest.update(part)
    return digest.digest()


def is_retry(retry_count: str | None) -> bool:
    """Whether an ``x-stainless-retry-count`` value says the request was sent before."""
    try:
        return retry_count is not None and int(retry_count) >= 1
    except ValueError:
        return False


class RefusedRequests:
    """The first sends of requests refused lately: kept ``window_s`` after their last refusal, at
    most ``max_entries`` (the oldest refusals are forgotten first)."""

    def __init__(self, window_s: float = 30.0, max_entries: int = 4096) -> None:
        if window_s <= 0 or max_entries < 1:
            raise ValueError("need window_s > 0 and max_entries >= 1")
        self.window_ns = int(window_s * 1e9)
        self.max_entries = max_entries
        self._first: OrderedDict[bytes, tuple[int, int]] = OrderedDict()  # key -> (first sent, last refused)

    def __len__(self) -> int:
        return len(self._first)

    def first_sent_ns(self, key: Callable[[], bytes], retry_count: str | None, received_ns: int) -> int:
        """When the request received at ``received_ns`` was first sent: the first send of the
        refused request it retries, else ``received_ns``. ``key`` makes the request's key, called
        only for a retry (the body's digest: most requests need none)."""
        if not is_retry(retry_count):
            return received_ns
        self._forget(received_ns)
        kept = self._first.get(key())
        return received_ns if kept is None else min(kept[0], received_ns)

    def refused(self, key: bytes, first_sent_ns: int, now_ns: int) -> None:
        """The request first sent at ``first_sent_ns`` was refused at ``now_ns``."""
        self._forget(now_ns)  # a refusal past the window is not this one's first send
        kept = self._first.pop(key, None)
        self._first[key] = (first_sent_ns if kept is None else min(kept[0], first_sent_ns), now_ns)
        self._forget(now_ns)

    def _forget(self, now_ns: int) -> None:
        first = self._first
        while first and (len(first) > self.max_entries or next(iter(first.values()))[1] + self.window_ns < now_ns):
            first.popitem(last=False)
