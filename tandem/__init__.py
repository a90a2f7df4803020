"""Tandem: LLM serving with prefill and decode multiplexed on one device."""

__version__ = "0.1.0"
