# Redis from Debian's package (scripts/build-base-images.sh): `redis-server ARGS` as in the
# official image (data in /data; protected mode off, as the official image does when no config
# file is given, because the server is reached over the compose network).
ARG BASE=flywheel/debian-base:bookworm
FROM ${BASE}
RUN apt-get update -q \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends redis-server \
 && rm -rf /var/lib/apt/lists/* \
 && mkdir -p /data && chown redis:redis /data
COPY redis-entrypoint.sh /usr/local/bin/flywheel-redis-entrypoint
WORKDIR /data
USER redis
VOLUME /data
EXPOSE 6379
ENTRYPOINT ["flywheel-redis-entrypoint"]
CMD ["redis-server"]
