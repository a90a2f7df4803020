# One image for every Tandem process (CPU build); compose.yaml picks the command.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    TANDEM_CACHE_DIR=/var/cache/tandem

WORKDIR /app
# The CPU build of torch is pinned in pyproject.toml; point PIP_EXTRA_INDEX_URL at a CPU wheel
# index at build time if the default index would resolve a CUDA build.
ARG PIP_EXTRA_INDEX_URL=""
COPY pyproject.toml README.md ./
COPY tandem ./tandem
COPY router ./router
COPY prefill_svc ./prefill_svc
COPY decode_svc ./decode_svc
COPY gpu_agent ./gpu_agent
COPY protos ./protos
RUN pip install "torch==2.13.0" && pip install .
# Bake the default model into the image so no container reaches a model hub at run time.
RUN tandem models pull-default

EXPOSE 50051
CMD ["tandem", "up", "--host", "0.0.0.0"]
