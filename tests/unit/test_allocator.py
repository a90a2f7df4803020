"""glibc's malloc settings for model processes (tandem.engine.allocator), each case in a fresh
interpreter: the settings are the process's."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

PROBE = """
import json, sys
from tandem.engine import allocator
before = dict(allocator._state)
if sys.argv[1] == "model":  # building a CPU model sets it
    from tandem.engine.attention import make_backend
    from tandem.engine.model import LlamaModel
    from tandem.engine.random_weights import random_weights, tiny_config
    config = tiny_config()
    LlamaModel(config, random_weights(config), make_backend("torch", config.num_heads))
    built = dict(allocator._state)
else:
    built = None
print(json.dumps({"before": before, "built": built, "tuned": allocator.tune_malloc(), "again": allocator.tune_malloc()}))
"""


def _probe(env_value: str | None, how: str) -> dict[str, object]:
    env = dict(os.environ)
    env.pop("TANDEM_MALLOC", None)
    if env_value is not None:
        env["TANDEM_MALLOC"] = env_value
    out = subprocess.run([sys.executable, "-c", PROBE, how], env=env, check=True, capture_output=True, text=True)
    result: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_glibc_is_set_once_unless_asked_not_to() -> None:
    assert _probe(None, "call") == {"before": {}, "built": None, "tuned": True, "again": True}
    assert _probe("default", "call") == {"before": {}, "built": None, "tuned": False, "again": False}
    assert _probe(None, "model") == {"before": {}, "built": {"tuned": True}, "tuned": True, "again": True}
    assert _probe("default", "model")["built"] == {"tuned": False}
