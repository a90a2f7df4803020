"""The router's configuration: flags with TANDEM_* twins, validated once."""

from __future__ import annotations

import json
import os
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tandem.engine.model_cache import resolve_model
from tandem.engine.tool_calls import TOOL_FORMATS
from tandem.policy.admission import DEFAULT_COLD_MARGIN, DEFAULT_MARGIN, DEFAULT_MISS_TARGET
from tandem.protocol import InvalidRequestError, SamplingDefaults
from tandem.service.flags import env_or, flag, parse_config


# uvicorn's HTTP/1.1 parser: "auto" takes httptools (C, a dependency) when it imports, else h11
# (pure Python). ``TANDEM_HTTP_PARSER=h11`` forces the pure one, for an A/B (docs/benchmarks.md: "A C HTTP
# parser, measured": 46-55 against 61-65 us of CPU an SSE chunk in uvicorn alone; not separated
# in the whole stack).
HTTP_PARSERS = ("auto", "httptools", "h11")


def http_parser() -> str:
    """The parser ``TANDEM_HTTP_PARSER`` names (default "auto"); ValueError for another name."""
    name = os.environ.get("TANDEM_HTTP_PARSER", "auto")
    if name not in HTTP_PARSERS:
        raise ValueError(f"TANDEM_HTTP_PARSER must be one of {', '.join(HTTP_PARSERS)}, got {name!r}")
    return name


DEFAULT_STALL_TIMEOUT_S = 30.0
DEFAULT_REQUEST_TIMEOUT_S = 600.0
# How long a request waits for an unreachable prefill_svc to come back (a restart) before it fails:
# as long as the stall timeout gives a decode_svc, since a cell restarted whole (its agent died)
# took 11-17 s on this 2-core host, prefill_svc the last to serve again.
DEFAULT_UPSTREAM_WAIT_S = 30.0
# The same defaults as gpu_agent's, so that admission and the partition policy share one SLO.
DEFAULT_TTFT_SLO_MS = 2000.0
DEFAULT_TBT_SLO_MS = 200.0


def _extra_models(text: str) -> tuple[tuple[str, Path], ...]:
    models = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, path = part.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--extra-model entries must be NAME=PATH, got {part!r}")
        models.append((name, resolve_model(path)))
    return tuple(models)


def _comma_list(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


@dataclass(frozen=True)
class RouterConfig:
    """Everything the router process needs; invalid values raise ValueError on construction.

    Upstreams come either from explicit addresses (both lists non-empty) or, when both lists
    are empty, from the Redis registry at ``redis_url`` (services of ``cell_id``; an empty
    ``cell_id`` means every cell). Explicit addresses win when both are given.
    """

    # Each field names its flag (with its TANDEM_* twin), the flag's default and help, and how the
    # flag's text becomes the field's value; parse_args is built from these alone. Fields without
    # a flag are for tests and embedders.
    model_dir: Path = field(metadata=flag("--model", "default", "model directory or 'default'", parse=resolve_model))
    host: str = field(metadata=flag("--host", "127.0.0.1", "address to listen on"))
    grpc_port: int = field(metadata=flag("--grpc-port", 50051, "gRPC port (0: any free port)", type=int))
    prefill_addresses: tuple[str, ...] = field(metadata=flag(
        "--prefill-address", "", "prefill_svc host:port (comma-separated for several)", parse=_comma_list))
    decode_addresses: tuple[str, ...] = field(metadata=flag(
        "--decode-address", "", "decode_svc host:port (comma-separated for several)", parse=_comma_list))
    redis_url: str = field(metadata=flag(
        "--redis-url", "", "Redis URL for discovery (REDIS_URL also works)", parse=env_or("REDIS_URL")))
    cell_id: str = field(metadata=flag("--cell-id", "cell0", "cell whose services the registry yields ('' for every cell)"))
    # decode services key their token streams by it; unique per process
    router_id: str = field(metadata=flag(
        "--router-id", "", "id decode services key this router's stream by (default: random)",
        parse=lambda text: text or f"router-{uuid.uuid4().hex[:12]}"))
    stall_timeout_s: float = field(metadata=flag(
        "--stall-timeout-s", DEFAULT_STALL_TIMEOUT_S, "give up on a request after this long without a decode update",
        type=float))
    request_timeout_s: float = field(metadata=flag(
        "--request-timeout-s", DEFAULT_REQUEST_TIMEOUT_S, "longest a request may run", type=float))
    # A prompt whose prefill service died or stopped before it answered is sent again (the client
    # has seen nothing of it): to another prefill service, or to the same one once restarted.
    prefill_resends: int = field(default=2, metadata=flag(
        "--prefill-resends", 2, "times a prompt is sent again when its prefill service dies or stops before "
        "answering (0: fail it at once)", type=int))
    upstream_wait_s: float = field(default=DEFAULT_UPSTREAM_WAIT_S, metadata=flag(
        "--upstream-wait-s", DEFAULT_UPSTREAM_WAIT_S, "how long a prompt waits for an unreachable prefill "
        "service to come back (a restart) before it fails", type=float))
    cancel_timeout_s: float = 2.0  # deadline of the best-effort Cancel RPCs sent upstream
    discovery_interval_s: float = 2.0  # how often the registry is re-read
    # vLLM's flag: the name the --model answers to (its directory's name when empty)
    served_model_name: str = field(default="", metadata=flag(
        "--served-model-name", "", "the name --model is served under (default: its directory's name)"))
    # More models of the cell, served by name beside --model (registry discovery only): the
    # services of each announce its name, as gpu_agent's --model entries name them.
    extra_models: tuple[tuple[str, Path], ...] = field(default=(), metadata=flag(
        "--extra-model", "", "more models served beside --model, comma-separated NAME=PATH (PATH a model "
        "directory or 'default'); their services are found in the registry by NAME", parse=_extra_models))
    # OpenAI-compatible HTTP API; None serves none (0: any free port)
    http_port: int | None = field(default=None, metadata=flag(
        "--http-port", 8000, "OpenAI-compatible HTTP port (0: any free port)", type=int))
    api_key: str = field(default="", metadata=flag(
        "--api-key", "", "if set, HTTP clients must send 'Authorization: Bearer <key>'"))
    # vLLM's flag (and default): the origins whose pages may call the HTTP API from a browser
    allowed_origins: tuple[str, ...] = field(default=("*",), metadata=flag(
        "--allowed-origins", "*", "origins whose web pages may call the HTTP API (CORS), comma-separated; "
        "'*' any, '' none", parse=_comma_list))
    # admission: a request's deadline is arrival + this
    ttft_slo_ms: float = field(default=DEFAULT_TTFT_SLO_MS, metadata=flag(
        "--ttft-slo-ms", DEFAULT_TTFT_SLO_MS, "time-to-first-token SLO of this model", type=float))
    # reported with the SLO; the agent's policy enforces it
    tbt_slo_ms: float = field(default=DEFAULT_TBT_SLO_MS, metadata=flag(
        "--tbt-slo-ms", DEFAULT_TBT_SLO_MS, "time-between-tokens SLO of this model", type=float))
    ttft_slo_ms_per_1k: float = field(default=0.0, metadata=flag(
        "--ttft-slo-ms-per-1k", 0.0, "the TTFT SLO grows by this per 1000 prompt tokens", type=float))
    admission: bool = field(default=True, metadata=flag(
        "--admission", "on", "refuse early (429) requests predicted to miss the TTFT SLO",
        parse=lambda text: text == "on", choices=["on", "off"]))
    admission_margin: float = field(default=DEFAULT_MARGIN, metadata=flag(
        "--admission-margin", DEFAULT_MARGIN, "refuse only a request whose first token is predicted later than "
        f"its deadline by more than this fraction of the TTFT SLO (a prediction is an estimate; {DEFAULT_COLD_MARGIN:g} "
        "until a batch has been measured)", type=float))
    admission_miss_target: float = field(default=DEFAULT_MISS_TARGET, metadata=flag(
        "--admission-miss-target", DEFAULT_MISS_TARGET, "the share of admitted requests allowed to miss the TTFT "
        "SLO: where more of the recent ones missed, admission takes only predictions as low as those that met it "
        "(never under half the SLO; 0: the margin alone)", type=float))
    stream_cap: bool = field(default=True, metadata=flag(
        "--stream-cap", "on", "with admission on, also cap the streams in flight where their token gaps "
        "approach the TBT SLO (refused: 429)", parse=lambda text: text == "on", choices=["on", "off"]))
    admission_log: str = field(default="", metadata=flag(
        "--admission-log", "", "append one JSON line per admission decision and per admitted request's first "
        "token to this file (prediction, limit, streams in flight, measured TTFT), for finding why requests "
        "missed or were refused (in a router of several models, one file each: the served name is added)"))
    profile: str = field(default="", metadata=flag(
        "--profile", "", "perf profile from `tandem profile` (default: the CPU placeholder)"))
    admission_cache: str = field(default="", metadata=flag(
        "--admission-cache", "", "keep admission's prefill calibration in this directory (one JSON file per "
        "served model), read back at start: a router restarted on the same host admits calibrated from its "
        "first request ('': not kept; `tandem up` keeps it under its cache root)"))
    # prefill_svc's batch limits, with which admission predicts how it batches its queue: the
    # same flags (and TANDEM_* twins) as prefill_svc's, so that one variable sets both.
    max_batch_tokens: int = field(default=4096, metadata=flag(
        "--max-batch-tokens", 4096, "prefill_svc's prompt tokens per batch (admission predicts its batches)",
        type=int))
    max_batch_requests: int = field(default=16, metadata=flag(
        "--max-batch-requests", 16, "prefill_svc's requests per batch (admission predicts its batches)", type=int))
    # Sampling defaults for what a request leaves out, as vLLM's --generation-config: "auto" takes
    # the model directory's generation_config.json values, "none" the built-in ones (temperature 1...).
    generation_config: str = field(default="auto", metadata=flag(
        "--generation-config", "auto", "sampling defaults for what a request leaves out: 'auto' "
        "(the model's generation_config.json) or 'none' (temperature 1, top_p 1, ...)", choices=["auto", "none"]))
    # A JSON object of generation_config.json keys (temperature, top_p, top_k, min_p,
    # repetition_penalty, max_new_tokens) that override either, e.g. '{"temperature": 0.7}'.
    override_generation_config: str = field(default="", metadata=flag(
        "--override-generation-config", "", "JSON object overriding those defaults, e.g. "
        "'{\"temperature\": 0.7, \"top_p\": 0.95}' (keys: temperature, top_p, top_k, min_p, "
        "repetition_penalty, max_new_tokens)"))

    # vLLM's flag: the format in which the answers of a model whose chat template renders tools
    # are read for calls ("auto": the one its template teaches); a template that does not render
    # tools gets Hermes' format told in a system message, whatever this says.
    tool_call_parser: str = field(default="auto", metadata=flag(
        "--tool-call-parser", "auto", "format of the tool calls in a model's answers when its chat template "
        "renders tools: 'auto' (the one the template teaches), 'hermes' (<tool_call> blocks), 'llama3_json' "
        "or 'mistral' ([TOOL_CALLS] lists)", choices=["auto", *TOOL_FORMATS]))

    def __post_init__(self) -> None:
        for flag_name, model_dir in (("--model", self.model_dir),
                                     *(("--extra-model", path) for _, path in self.extra_models)):
            if not (model_dir / "config.json").is_file():
                raise ValueError(f"{flag_name} {model_dir} has no config.json")
            if not (model_dir / "tokenizer.json").is_file():
                raise ValueError(f"{flag_name} {model_dir} has no tokenizer.json; the router tokenizes")
        names = [name for name, _ in self.served_models]
        if len(set(names)) != len(names):
            raise ValueError(f"served model names must be unique, got {names}")
        if self.extra_models and self.static_upstreams:
            raise ValueError("--extra-model needs registry discovery (--redis-url), not fixed addresses")
        if not 0 <= self.admission_miss_target < 1:
            raise ValueError(f"--admission-miss-target must be in [0, 1), got {self.admission_miss_target}")
        if not 0 <= self.admission_margin <= DEFAULT_COLD_MARGIN:
            raise ValueError(f"--admission-margin must be in [0, {DEFAULT_COLD_MARGIN:g}] (the cold start's margin), "
                             f"got {self.admission_margin}")
        if not 0 <= self.grpc_port <= 65535:
            raise ValueError(f"--grpc-port must be in [0, 65535], got {self.grpc_port}")
        if self.http_port is not None:
            if not 0 <= self.http_port <= 65535:
                raise ValueError(f"--http-port must be in [0, 65535], got {self.http_port}")
            http_parser()  # a bad TANDEM_HTTP_PARSER fails here, one clear line, not at the HTTP start
        for flag_name, addresses in (("--prefill-address", self.prefill_addresses),
                                     ("--decode-address", self.decode_addresses)):
            for address in addresses:
                _check_address(flag_name, address)
        if bool(self.prefill_addresses) != bool(self.decode_addresses):
            raise ValueError("give both --prefill-address and --decode-address, or neither (registry discovery)")
        if not self.prefill_addresses and not self.redis_url:
            raise ValueError("no upstreams: give --prefill-address and --decode-address, or --redis-url")
        if not self.router_id or any(c.isspace() for c in self.router_id):
            raise ValueError(f"--router-id must be non-empty without spaces, got {self.router_id!r}")
        if self.tool_call_parser not in ("auto", *TOOL_FORMATS):
            raise ValueError(f"--tool-call-parser must be one of auto, {', '.join(TOOL_FORMATS)}, "
                             f"got {self.tool_call_parser!r}")
        if self.generation_config not in ("auto", "none"):
            raise ValueError(f"--generation-config must be 'auto' or 'none', got {self.generation_config!r}")
        try:
            self.generation_overrides()
        except (ValueError, InvalidRequestError) as exc:
            raise ValueError(f"--override-generation-config: {exc}") from None
        if self.prefill_resends < 0 or self.upstream_wait_s < 0:
            raise ValueError(f"--prefill-resends and --upstream-wait-s must be >= 0, got {self.prefill_resends} "
                             f"and {self.upstream_wait_s}")
        for name in ("stall_timeout_s", "request_timeout_s", "cancel_timeout_s", "discovery_interval_s",
                     "ttft_slo_ms", "tbt_slo_ms", "max_batch_tokens", "max_batch_requests"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    @property
    def primary_model_name(self) -> str:
        return self.served_model_name or self.model_dir.name

    @property
    def served_models(self) -> list[tuple[str, Path]]:
        """(served name, directory) of every model, ``--model`` first."""
        return [(self.primary_model_name, self.model_dir), *self.extra_models]

    def generation_overrides(self) -> dict[str, Any]:
        """``override_generation_config`` as a dict; ValueError when it is not a JSON object of
        known keys with values in range."""
        if not self.override_generation_config:
            return {}
        overrides = json.loads(self.override_generation_config)
        if not isinstance(overrides, dict):
            raise ValueError(f"expected a JSON object, got {self.override_generation_config!r}")
        SamplingDefaults.from_generation_config({}, overrides)  # checks keys and ranges
        return overrides

    def sampling_defaults(self, model_dir: Path | None = None) -> SamplingDefaults:
        """The defaults requests for the model in ``model_dir`` (default: ``--model``) get (its
        generation_config.json with "auto")."""
        generation_config: dict[str, Any] = {}
        path = (model_dir or self.model_dir) / "generation_config.json"
        if self.generation_config == "auto" and path.is_file():
            generation_config = json.loads(path.read_text(encoding="utf-8"))
        return SamplingDefaults.from_generation_config(generation_config, self.generation_overrides())

    @property
    def static_upstreams(self) -> bool:
        """True when upstream addresses come from flags rather than the registry."""
        return bool(self.prefill_addresses)


def _check_address(flag: str, address: str) -> None:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) <= 65535:
        raise ValueError(f"{flag} entries must be host:port, got {address!r}")


def parse_args(argv: list[str] | None = None) -> RouterConfig:
    """Build the config from ``argv`` and TANDEM_* variables: one flag per field that declares one.

    Resolving ``--model default`` may pull the default model into the cache (once); raises
    ModelLoadError when the model cannot be found and ValueError for invalid values.
    """
    return parse_config(RouterConfig, argv, "router", "Tandem's public gRPC API: tokenize, route, stream")
