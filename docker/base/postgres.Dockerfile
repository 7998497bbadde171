# PostgreSQL from Debian's package, for machines that cannot pull the postgres image
# (scripts/build-base-images.sh). Behaves like the official image where the compose file relies
# on it: POSTGRES_USER / POSTGRES_PASSWORD / POSTGRES_DB create the superuser and the database on
# first start, the data live in /var/lib/postgresql/data, and pg_isready answers.
ARG BASE=flywheel/debian-base:bookworm
FROM ${BASE}
RUN apt-get update -q \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends postgresql \
 && rm -rf /var/lib/apt/lists/* /var/lib/postgresql/*/main /etc/postgresql/*/main
ENV PGDATA=/var/lib/postgresql/data
RUN set -e; bindir=$(ls -d /usr/lib/postgresql/*/bin | tail -n 1); \
    for f in "$bindir"/*; do ln -sf "$f" /usr/local/bin/; done; \
    mkdir -p "$PGDATA" /var/run/postgresql; \
    chown -R postgres:postgres /var/lib/postgresql /var/run/postgresql; chmod 700 "$PGDATA"
COPY postgres-entrypoint.sh /usr/local/bin/flywheel-postgres-entrypoint
USER postgres
VOLUME /var/lib/postgresql/data
EXPOSE 5432
STOPSIGNAL SIGINT
ENTRYPOINT ["flywheel-postgres-entrypoint"]
CMD ["postgres"]
