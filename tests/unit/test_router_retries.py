"""``RefusedRequests``: a request that says it is a retry and matches one refused lately takes
that one's first send; anything else keeps its own arrival. Checked against a plain model of
the rule on random sequences of refusals and lookups."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.retries import RefusedRequests, is_retry, retry_key

WINDOW_NS = 1_000


def test_what_counts_as_a_retry_and_what_tells_requests_apart() -> None:
    assert [is_retry(v) for v in (None, "", "0", "1", "2", "x", "-1", " 3")] == \
        [False, False, False, True, True, False, False, True]
    keys = {retry_key(path, api_key, body) for path in ("/v1/completions", "/v1/chat/completions")
            for api_key in ("", "Bearer a") for body in (b"{}", b'{"a":1}')}
    assert len(keys) == 8
    assert retry_key("/a", "b", b"c") == retry_key("/a", "b", b"c")
    assert retry_key("/ab", "", b"c") != retry_key("/a", "b", b"c")  # the parts do not run together
    with pytest.raises(ValueError):
        RefusedRequests(window_s=0)
    with pytest.raises(ValueError):
        RefusedRequests(max_entries=0)


events = st.lists(st.tuples(st.sampled_from(["refuse", "ask"]), st.integers(0, 5), st.integers(0, 400),
                            st.sampled_from([None, "0", "1", "2", "bad"])), max_size=120)


@settings(max_examples=150, deadline=None)
@given(events, st.integers(1, 8))
def test_a_retry_takes_the_first_send_of_the_refusal_it_repeats(steps: list[tuple[str, int, int, str | None]],
                                                               max_entries: int) -> None:
    refused = RefusedRequests(window_s=WINDOW_NS / 1e9, max_entries=max_entries)
    model: dict[bytes, tuple[int, int]] = {}  # key -> (first sent, last refused), oldest refusal first
    now_ns = 0
    for kind, which, advance_ns, count in steps:
        now_ns += advance_ns
        key = retry_key("/v1/completions", "", bytes([which]))
        # what the rule keeps: refused within the window, the latest max_entries refusals
        model = {k: v for k, v in model.items() if v[1] + WINDOW_NS >= now_ns}
        if kind == "ask":
            kept = model.get(key)
            expected = kept[0] if is_retry(count) and kept is not None else now_ns
            assert refused.first_sent_ns(lambda: key, count, now_ns) == expected
        else:
            first_ns = now_ns - (advance_ns // 2)  # sent a while before it was refused
            kept = model.pop(key, None)
            model[key] = (first_ns if kept is None else min(kept[0], first_ns), now_ns)
            while len(model) > max_entries:
                del model[next(iter(model))]
            refused.refused(key, first_ns, now_ns)
        assert len(refused) <= max_entries


def test_a_first_send_never_makes_its_key() -> None:
    """The key is the body's digest: a request that is no retry never pays for it."""
    def digest() -> bytes:
        raise AssertionError("the key was made for a first send")

    refused = RefusedRequests()
    for count in (None, "0", "-1", "x", ""):
        assert refused.first_sent_ns(digest, count, 5) == 5
