"""Contenders of the live policy benchmarks: ``LABEL=POLICY[:NAME=VALUE,...]``."""

from __future__ import annotations

import argparse
import random

import pytest

from tandem.bench.variant import Variant, parse_variant, resolve


def test_variants_parse_and_resolve() -> None:
    rng = random.Random(1)
    for _ in range(50):
        env = {f"TANDEM_X{i}": rng.choice(["on", "off", "a=b", "3"]) for i in range(rng.randrange(0, 3))}
        policy = rng.choice(["chunked", "dynamic", "static", "adaptive"])
        text = f"v{rng.randrange(99)}={policy}" + (":" + ",".join(f"{k}={v}" for k, v in env.items()) if env else "")
        variant = parse_variant(text)
        assert variant == Variant(variant.label, policy, env)
        assert resolve(variant.label, [variant]) == (policy, env)
    assert resolve("chunked", [parse_variant("x=dynamic:A=1")]) == ("chunked", {})
    for bad in ("dynamic", "=dynamic", "x=fast", "x=dynamic:NOVALUE"):
        with pytest.raises(argparse.ArgumentTypeError, match="LABEL=POLICY"):
            parse_variant(bad)
