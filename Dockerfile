# Flywheel services image (production). GPU hosts: ACCEL=gpu installs vLLM's CUDA build.
FROM python:3.11-slim
ARG ACCEL=gpu
WORKDIR /app
RUN apt-get update && apt-get install -y --no-install-recommends build-essential && rm -rf /var/lib/apt/lists/*
COPY pyproject.toml README.md ./
COPY flywheel flywheel
COPY ingest ingest
COPY rewarding rewarding
COPY trainer trainer
COPY serving serving
# flywheel/core/db/migrations links to it: the package carries the migrations through the link
COPY migrations migrations
RUN pip install --no-cache-dir ".[${ACCEL}]"
USER 1000:1000
ENV FLYWHEEL_ENVIRONMENT=production
