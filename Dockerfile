# syntax=docker/dockerfile:1.7
#
# One image for every deepserve process (gateway, router, engine workers, `deepserve up`).
#
#   docker build -t deepserve:cpu .                         # CPU torch wheel (default)
#   docker build -t deepserve:cuda --build-arg VARIANT=cuda .  # CUDA torch wheel, NVIDIA hosts
#
# Stage 1 (build) installs torch for the chosen variant and then deepserve with its pinned
# dependencies into /opt/venv; stage 2 (runtime) copies only that venv onto a clean slim base, adds
# a non-root user and the health-check helper. torch's CUDA wheels bundle the CUDA runtime
# libraries, so the CUDA variant needs only the host driver (NVIDIA Container Toolkit), not a CUDA
# base image; it does add a C compiler because Triton compiles its launcher stubs at run time.

ARG PYTHON_VERSION=3.12
ARG VARIANT=cpu

# ---------------------------------------------------------------------------------------------
FROM python:${PYTHON_VERSION}-slim-bookworm AS build
ARG VARIANT
# Keep in step with the Makefile's TORCH pin.
ARG TORCH_VERSION=2.13.0
# CPU wheels come from PyTorch's CPU index (no CUDA libraries, ~5x smaller); the default index's
# Linux wheels are the CUDA builds. Override TORCH_INDEX_URL to pick another CUDA minor version.
ARG TORCH_CPU_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG TORCH_INDEX_URL=

ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_INPUT=1 \
    PYTHONDONTWRITEBYTECODE=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH

# torch first and alone: the largest layer, and the one that changes least often.
RUN --mount=type=cache,target=/root/.cache/pip \
    set -eu; \
    case "$VARIANT" in \
      cpu)  index="${TORCH_INDEX_URL:-$TORCH_CPU_INDEX_URL}" ;; \
      cuda) index="${TORCH_INDEX_URL}" ;; \
      *)    echo "VARIANT must be cpu or cuda, got '$VARIANT'" >&2; exit 2 ;; \
    esac; \
    if [ -n "$index" ]; then \
      pip install "torch==${TORCH_VERSION}" --index-url "$index"; \
    else \
      pip install "torch==${TORCH_VERSION}"; \
    fi

WORKDIR /src
COPY pyproject.toml requirements.lock ./
COPY deepserve ./deepserve
COPY engine ./engine
COPY kvstore ./kvstore
COPY router ./router
COPY server ./server
COPY kernels ./kernels
COPY bench ./bench
# A regular (non-editable) install: the runtime stage never sees /src. Every dependency is pinned
# by requirements.lock, except that a CUDA torch keeps the triton it was built with.
RUN --mount=type=cache,target=/root/.cache/pip \
    set -eu; \
    if [ "$VARIANT" = cuda ]; then grep -v '^triton==' requirements.lock > /tmp/constraints.txt; \
    else cp requirements.lock /tmp/constraints.txt; fi; \
    pip install -c /tmp/constraints.txt . \
 && deepserve --help >/dev/null

# ---------------------------------------------------------------------------------------------
FROM python:${PYTHON_VERSION}-slim-bookworm AS runtime
ARG VARIANT
ARG UID=10001

# Triton (CUDA variant) JIT-compiles small C launchers with the system compiler.
RUN set -eu; \
    if [ "$VARIANT" = cuda ]; then \
      apt-get update; \
      apt-get install -y --no-install-recommends gcc libc6-dev; \
      rm -rf /var/lib/apt/lists/*; \
    fi

# Fixed uid/gid so volume ownership is predictable (Kubernetes runAsUser/fsGroup use the same).
# /models and the KV directories are created here, owned by that user, so that a fresh named
# volume mounted on them inherits the ownership and the non-root process can write.
RUN groupadd --system --gid "$UID" deepserve \
 && useradd --system --uid "$UID" --gid deepserve --create-home --home-dir /home/deepserve deepserve \
 && mkdir -p /models /var/cache/deepserve/kv /mnt/kv-shared \
 && chown -R deepserve:deepserve /models /var/cache/deepserve /mnt/kv-shared

COPY --from=build /opt/venv /opt/venv
COPY --chmod=0755 deploy/docker/healthcheck.py /usr/local/bin/deepserve-healthcheck

ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/home/deepserve \
    DEEPSERVE_VARIANT=${VARIANT}

USER deepserve
WORKDIR /home/deepserve

# gateway 8000, router 8100, engine workers 8200+ (see docs/OPERATIONS.md).
EXPOSE 8000 8100 8200 8201

# Checks the gateway port of `deepserve up` (or DEEPSERVE_HEALTHCHECK_URL); docker-compose.yml
# gives each service its own URL and Kubernetes uses its own probes.
HEALTHCHECK --interval=10s --timeout=5s --start-period=120s --retries=3 \
    CMD ["deepserve-healthcheck"]

ENTRYPOINT ["deepserve"]
# Without arguments the image runs the all-in-one embedded stack.
CMD ["up", "--host", "0.0.0.0", "--port", "8000"]
