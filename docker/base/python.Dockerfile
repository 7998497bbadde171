# Python 3.11 with venv from Debian's packages (scripts/build-base-images.sh): a stand-in for
# python:3.11-slim as the services image's base (docker build --build-arg BASE=...).
ARG BASE=flywheel/debian-base:bookworm
FROM ${BASE}
RUN apt-get update -q \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
      python3.11 python3.11-venv libnuma1 \
 && rm -rf /var/lib/apt/lists/* \
 && ln -sf /usr/bin/python3.11 /usr/local/bin/python3 && ln -sf /usr/bin/python3.11 /usr/local/bin/python
CMD ["python3"]
