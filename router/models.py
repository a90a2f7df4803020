"""The models a router serves: one ``RouterCore`` each, picked by a request's ``model`` field.

The first model is the primary: it also answers to "" and "default". A name no core answers to
is NOT_FOUND, naming every model served (HTTP 404 with OpenAI's ``model_not_found``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

from router.core import RouterCore, brief
from router.in_flight import InFlight
from router.upstream import Readiness
from tandem.protocol import RequestError, Status


class ServedModels:
    def __init__(self, cores: list[RouterCore]) -> None:
        if not cores:
            raise ValueError("a router serves at least one model")
        names = [core.model_id for core in cores]
        if len(set(names)) != len(names):
            raise ValueError(f"served model names must be unique, got {names}")
        self._cores = list(cores)
        self.in_flight = InFlight()  # every API's requests, for a stopping router to end

    def __iter__(self) -> Iterator[RouterCore]:
        return iter(self._cores)

    @property
    def primary(self) -> RouterCore:
        return self._cores[0]

    @property
    def names(self) -> list[str]:
        return [core.model_id for core in self._cores]

    def pick(self, model: str) -> RouterCore:
        """The core serving ``model``; RequestError NOT_FOUND (field ``model``) when none does."""
        for core in self._cores:
            if model == core.model_id:
                return core
        for core in self._cores:
            if model in core.model_names:
                return core
        raise RequestError(Status.NOT_FOUND, f"model {brief(model)} is not served here; this router serves "
                           f"{', '.join(repr(n) for n in self.names)}", field="model")

    async def readiness(self) -> Readiness:
        """Ready when every model has a reachable prefill and decode service."""
        each = await asyncio.gather(*(core.upstream.readiness() for core in self._cores))
        if len(self._cores) == 1:
            return each[0]
        ready = all(r.ready for r in each)
        return Readiness(ready, "; ".join(f"{core.model_id}: {r.detail}" for core, r in zip(self._cores, each)))

    async def close(self) -> None:
        await asyncio.gather(*(core.close() for core in self._cores))
