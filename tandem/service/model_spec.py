"""What a ``--model`` entry of a cell says: a model directory and how the cell serves it.

A comma-separated list of ``PATH[:name=NAME][:kv=DTYPE][:quant=FORMAT]`` (``PATH`` a model
directory or ``default``); ``gpu_agent --model`` and ``tandem up --model`` (repeated) take them.
A model's served name defaults to its directory's name, with ``-kv-<dtype>`` / ``-<format>``
appended for the options given, and must be unique in the cell. Torch-free: the launcher and the
router read it too.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tandem.engine.weight_format import WeightFormat

KV_DTYPES = ("float32", "bfloat16", "float16")
_OPTIONS = ("name", "kv", "quant")


@dataclass(frozen=True)
class ModelSpec:
    """One ``--model`` entry: where the model is and how the cell runs it (empty: the cell's
    ``--kv-dtype`` / ``--quantization``)."""

    path: str
    name: str = ""
    kv_dtype: str = ""
    quantization: str = ""

    @classmethod
    def parse(cls, text: str) -> ModelSpec:
        path, *options = text.strip().split(":")
        if not path:
            raise ValueError(f"--model entry {text!r} has no model path")
        values: dict[str, str] = {}
        for option in options:
            key, sep, value = option.partition("=")
            if not sep or key not in _OPTIONS or not value or key in values:
                raise ValueError(f"--model entry {text!r}: expected PATH[:name=NAME][:kv=DTYPE][:quant=FORMAT], "
                                 f"got option {option!r}")
            values[key] = value
        if values.get("kv", "float32") not in KV_DTYPES:
            raise ValueError(f"--model entry {text!r}: kv must be one of {KV_DTYPES}")
        if "quant" in values:
            WeightFormat.parse(values["quant"])  # ValueError naming the formats
        return cls(path, values.get("name", ""), values.get("kv", ""), values.get("quant", ""))

    def served_name(self, model_dir: Path) -> str:
        if self.name:
            return self.name
        suffix = (f"-kv-{self.kv_dtype}" if self.kv_dtype else "") + (f"-{self.quantization}" if self.quantization else "")
        return model_dir.name + suffix


def parse_models(text: str) -> tuple[ModelSpec, ...]:
    specs = tuple(ModelSpec.parse(part) for part in text.split(",") if part.strip())
    if not specs:
        raise ValueError("--model needs at least one model")
    return specs
