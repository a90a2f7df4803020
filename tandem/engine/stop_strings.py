"""Stop strings over a stream of text deltas.

A stop string can arrive split across any number of deltas ("EN" then "D"), so text that might
be the start of one cannot be emitted yet. ``StopStringMatcher`` holds back exactly the longest
tail of the text seen so far that is a proper prefix of some stop string, and nothing else, so
output is delayed by at most ``max(len(stop)) - 1`` characters and only while a match is
still possible.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

from tandem.engine.errors import InvalidRequestError


class StopFeed(NamedTuple):
    """What one ``StopStringMatcher.feed`` produced."""

    text: str  # safe to emit now; on a match, everything before the stop string
    stop: str | None  # the stop string that matched, or None

    @property
    def stopped(self) -> bool:
        return self.stop is not None


class StopStringMatcher:
    """Finds the first stop string to appear in text fed piece by piece.

    Contract:
    - the concatenation of every ``feed(...).text`` and ``flush()`` equals the fed text cut
      just before the stop string whose first occurrence *ends* first (ties: the one that
      starts first), or all of it when none occurs; the stop string itself and anything after
      it are never returned. Ordering by end makes the result independent of how the text was
      split into deltas: a stream stops at the first character that completes a stop string;
    - ``feed`` holds back only a tail that is a proper prefix of some stop string; a tail that
      can no longer become one is released by the next ``feed`` (no false holds);
    - after a match, ``feed`` returns empty text and ``flush`` returns "": the request is over.
    With no stop strings every ``feed`` returns its input unchanged.
    """

    def __init__(self, stop: Iterable[str]) -> None:
        """Raises InvalidRequestError for an empty stop string (it would match everywhere)."""
        stops = tuple(dict.fromkeys(stop))
        for s in stops:
            if not isinstance(s, str) or not s:
                raise InvalidRequestError(f"stop strings must be non-empty strings, got {s!r}")
        self._stops = stops
        self._held = ""
        self._stop: str | None = None

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return self._stops

    @property
    def stopped(self) -> bool:
        """True once a stop string matched."""
        return self._stop is not None

    @property
    def held_text(self) -> str:
        """Text fed but not yet returned (a possible start of a stop string)."""
        return self._held

    def feed(self, delta: str) -> StopFeed:
        """Add ``delta``; return the text that is now safe to emit and whether a stop matched."""
        if self._stop is not None:
            return StopFeed("", None)
        if not self._stops:
            return StopFeed(delta, None)
        text = self._held + delta
        match = self._earliest_match(text)
        if match is not None:
            position, stop = match
            self._held = ""
            self._stop = stop
            return StopFeed(text[:position], stop)
        # No stop string occurs in `text`, so any future match must start inside a tail that
        # is already a prefix of a stop string; everything before the longest such tail is safe.
        num_held = self._longest_partial_tail(text)
        self._held = text[len(text) - num_held :]
        return StopFeed(text[: len(text) - num_held], None)

    def flush(self) -> str:
        """Release the held tail at the end of the stream (it can no longer complete a stop)."""
        held, self._held = self._held, ""
        return "" if self._stop is not None else held

    def _earliest_match(self, text: str) -> tuple[int, str] | None:
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for stop in self._stops:
            start = text.find(stop)
            if start >= 0:
                candidate = (start + len(stop), start, stop)
                if best is None or candidate[:2] < best[:2]:
                    best = candidate
        return None if best is None else (best[1], best[2])

    def _longest_partial_tail(self, text: str) -> int:
        longest = 0
        for stop in self._stops:
            # Only proper prefixes: a full occurrence was already ruled out by _earliest_match.
            for length in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:length]):
                    longest = length
                    break
        return longest
