# Two images from one file, chosen with --target (compose.yaml builds both):
#
#   docker build --target scheduler -t llmserve-scheduler .
#   docker build --target worker    -t llmserve-worker .
#
# scheduler: CPU only. The scheduler service imports no torch, triton, transformers or
#   safetensors (a test enforces the torch part), so this image installs the project's
#   dependencies without them and the project itself with --no-deps: a few hundred MB
#   instead of several GB. It also runs the OpenAI HTTP gateway (`llmserve gateway`: smg,
#   a main dependency). Structured outputs need xgrammar, whose Python package imports torch
#   and transformers: left out here too, so this scheduler refuses constrained requests with
#   UNIMPLEMENTED; run `llmserve scheduler` from the worker image to serve them.
# worker: everything, plus the `prepare` extra so that it can also run
#   `llmserve prepare-model` (compose's model-prep service, the Kubernetes init containers).
#   torch comes from the default index, whose Linux x86_64 wheels are CUDA builds that
#   carry their CUDA libraries as pip packages, so a slim Python base is enough: the GPU
#   driver is mounted by the NVIDIA container toolkit at run time. The same image runs a
#   CPU worker (`--device cpu`).
#
# Both run as the unprivileged user `llmserve` (uid 1000) with LLMSERVE_CACHE=/cache; /cache
# and /secrets (where compose.yaml keeps the worker token) belong to that user, so a named
# volume mounted at either starts out writable by it.

ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS base
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    LLMSERVE_CACHE=/cache
RUN useradd --create-home --uid 1000 llmserve \
    && mkdir -p /cache /secrets \
    && chown llmserve:llmserve /cache /secrets \
    && chmod 0700 /secrets
WORKDIR /src
# Only what the requirements are read from: the dependency layer is rebuilt when they
# change, not when the source does.
COPY pyproject.toml ./
COPY deploy/requirements.py deploy/


FROM base AS scheduler
RUN python deploy/requirements.py --exclude torch triton transformers safetensors xgrammar > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt \
    && rm /tmp/requirements.txt
COPY README.md ./
COPY llmserve/ llmserve/
COPY common/ common/
COPY scheduler_svc/ scheduler_svc/
COPY worker_svc/ worker_svc/
COPY kernels/ kernels/
RUN pip install --no-deps . && rm -rf build
USER llmserve
WORKDIR /home/llmserve
# The scheduler (gRPC, metrics); `llmserve gateway` from the same image (HTTP, metrics).
EXPOSE 50051 9090 8000 9092
ENTRYPOINT ["llmserve"]
CMD ["scheduler", "--host", "0.0.0.0", "--port", "50051"]


FROM base AS worker
# Triton compiles a small C launcher for its kernels when it first loads them, and a CPU
# worker compiles our C++ kernels (kernels/cpu/) on its first start.
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc g++ libc6-dev \
    && rm -rf /var/lib/apt/lists/*
RUN python deploy/requirements.py --extra prepare > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt \
    && rm /tmp/requirements.txt
COPY README.md ./
COPY llmserve/ llmserve/
COPY common/ common/
COPY scheduler_svc/ scheduler_svc/
COPY worker_svc/ worker_svc/
COPY kernels/ kernels/
RUN pip install --no-deps . && rm -rf build
USER llmserve
WORKDIR /home/llmserve
EXPOSE 50052 9091
ENTRYPOINT ["llmserve"]
CMD ["worker", "--listen", "0.0.0.0:50052"]
