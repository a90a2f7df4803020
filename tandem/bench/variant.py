"""A contender of a live policy comparison: a policy under environment overrides.

``LABEL=POLICY[:NAME=VALUE,...]``, e.g. ``dynamic-uncalibrated=dynamic:TANDEM_SPLIT_CALIBRATION=off``
or ``chunked-eager=chunked:TANDEM_CUDA_GRAPHS=off``: the benchmark drivers (``bench/live_policies.py``,
``bench/cuda_live.py``) start ``tandem up --policy POLICY`` with those variables set and report it
under LABEL, beside the plain policies, on the same requests.
"""

from __future__ import annotations

import argparse
from typing import NamedTuple

from tandem.policy.policies import POLICIES


class Variant(NamedTuple):
    label: str
    policy: str
    env: dict[str, str]


def parse_variant(text: str) -> Variant:
    """``LABEL=POLICY[:NAME=VALUE,...]`` → its Variant; a clear error otherwise."""
    label, _, rest = text.partition("=")
    policy, _, env_text = rest.partition(":")
    items = [item for item in env_text.split(",") if item]
    if not label or policy not in POLICIES or any("=" not in item for item in items):
        raise argparse.ArgumentTypeError(f"a variant is LABEL=POLICY[:NAME=VALUE,...] with a policy of "
                                         f"{', '.join(sorted(POLICIES))}, got {text!r}")
    return Variant(label, policy, dict(item.split("=", 1) for item in items))


def resolve(label: str, variants: list[Variant]) -> tuple[str, dict[str, str]]:
    """The policy and environment overrides a contender's label stands for (a plain policy: none)."""
    for variant in variants:
        if variant.label == label:
            return variant.policy, dict(variant.env)
    return label, {}
