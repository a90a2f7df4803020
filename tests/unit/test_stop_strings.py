"""StopStringMatcher: stop strings split across deltas, several and overlapping stop strings,
and text that is held back only while it can still become a stop string."""

from __future__ import annotations

import random

import pytest

from tandem.engine.errors import InvalidRequestError
from tandem.engine.stop_strings import StopStringMatcher


def _run(stops: list[str], deltas: list[str]) -> tuple[list[str], str | None, str]:
    """Feed ``deltas``; return the per-feed outputs, the matched stop and the flushed tail."""
    matcher = StopStringMatcher(stops)
    outputs: list[str] = []
    matched: str | None = None
    for delta in deltas:
        result = matcher.feed(delta)
        outputs.append(result.text)
        if result.stopped:
            matched = result.stop
            break
    return outputs, matched, matcher.flush()


def _reference(stops: list[str], text: str) -> tuple[str, str | None]:
    """The whole text cut before the stop string that is completed first."""
    best: tuple[int, int, str] | None = None
    for stop in stops:
        start = text.find(stop)
        if start >= 0 and (best is None or (start + len(stop), start) < best[:2]):
            best = (start + len(stop), start, stop)
    return (text, None) if best is None else (text[: best[1]], best[2])


def test_no_stop_strings_passes_text_through() -> None:
    matcher = StopStringMatcher([])
    assert matcher.feed("Hello").text == "Hello"
    assert matcher.feed("").text == ""
    assert matcher.flush() == ""


def test_stop_string_split_across_deltas_is_held_then_cut() -> None:
    outputs, matched, tail = _run(["END"], ["The ", "story E", "N", "D and more"])
    assert outputs == ["The ", "story ", "", ""]
    assert matched == "END"
    assert tail == ""


def test_held_prefix_is_released_when_it_stops_matching() -> None:
    matcher = StopStringMatcher(["END"])
    first = matcher.feed("hello E")
    assert first.text == "hello " and matcher.held_text == "E"
    second = matcher.feed("Nx")
    # "ENx" can no longer start "END": all of it goes out, nothing stays held.
    assert second.text == "ENx" and not second.stopped and matcher.held_text == ""


def test_flush_releases_a_partial_stop_at_the_end() -> None:
    outputs, matched, tail = _run(["</answer>"], ["42 </ans"])
    assert outputs == ["42 "] and matched is None
    assert tail == "</ans"


def test_no_false_hold_for_text_that_is_not_a_prefix() -> None:
    # "D" ends the text and occurs in "END", but not at its start: nothing to hold.
    matcher = StopStringMatcher(["END"])
    assert matcher.feed("AND").text == "AND"
    assert matcher.held_text == ""


def test_multiple_stop_strings_first_completed_wins() -> None:
    outputs, matched, _ = _run(["world", "lo"], ["Hel", "lo world"])
    assert "".join(outputs) == "Hel" and matched == "lo"


def test_overlapping_prefixes_hold_the_longest_candidate() -> None:
    # "ab" is a prefix of "abc" and ends in "b", a prefix of "bd": the longest tail is held.
    matcher = StopStringMatcher(["abc", "bd"])
    first = matcher.feed("xab")
    assert first.text == "x" and matcher.held_text == "ab"
    second = matcher.feed("d")
    assert second.stopped and second.stop == "bd"
    assert second.text == "a"


def test_repeated_characters_in_stop_string() -> None:
    # A naive matcher that restarts after a failed partial match misses this one.
    outputs, matched, _ = _run(["aab"], ["a", "a", "a", "b", "c"])
    assert "".join(outputs) == "a" and matched == "aab"


def test_stop_at_the_very_start() -> None:
    outputs, matched, _ = _run(["<|end|>"], ["<|", "end|>tail"])
    assert outputs == ["", ""] and matched == "<|end|>"


def test_feed_after_a_match_returns_nothing() -> None:
    matcher = StopStringMatcher(["."])
    assert matcher.feed("one. two").text == "one"
    after = matcher.feed("three")
    assert after.text == "" and not after.stopped
    assert matcher.flush() == ""


def test_empty_stop_string_is_refused() -> None:
    with pytest.raises(InvalidRequestError, match="non-empty"):
        StopStringMatcher(["ok", ""])


@pytest.mark.parametrize("seed", range(20))
def test_any_split_gives_the_same_result_as_the_whole_text(seed: int) -> None:
    rng = random.Random(seed)
    alphabet = "abc"
    stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
    text = "".join(rng.choice(alphabet) for _ in range(30))
    cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, 10)))
    deltas = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    outputs, matched, tail = _run(stops, deltas)
    assert ("".join(outputs) + tail, matched) == _reference(stops, text)
