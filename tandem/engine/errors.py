"""Errors the engine raises for bad input; each message names the problem."""

from __future__ import annotations

from tandem.protocol import InvalidRequestError, TandemError

__all__ = ["InvalidRequestError", "ModelLoadError", "OutOfBlocksError", "TandemError"]


class ModelLoadError(TandemError):
    """A model directory or file cannot be loaded (missing file, unknown architecture, bad shape)."""


class OutOfBlocksError(TandemError):
    """The KV pool has too few free blocks for an allocation."""
