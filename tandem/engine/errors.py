"""Errors the engine raises for bad input; each message names the problem."""

from __future__ import annotations


class TandemError(Exception):
    """Base of every error Tandem raises on purpose."""


class ModelLoadError(TandemError):
    """A model directory or file cannot be loaded (missing file, unknown architecture, bad shape)."""


class InvalidRequestError(TandemError):
    """A request is malformed: bad sampling parameters, a prompt longer than the context, ..."""


class OutOfBlocksError(TandemError):
    """The KV pool has too few free blocks for an allocation."""
