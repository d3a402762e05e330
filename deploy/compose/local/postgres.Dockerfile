# A stand-in for postgres:16 from Debian bookworm's postgresql-15: the same contract docker-compose.yml uses
# (POSTGRES_USER, POSTGRES_PASSWORD and POSTGRES_DB make the cluster on first start in /var/lib/postgresql/data,
# which a volume keeps; pg_isready on PATH; listens on 5432 with password logins).
ARG DEBIAN_IMAGE=genq-local/debian:bookworm
FROM ${DEBIAN_IMAGE}
RUN apt-get update && apt-get install -y --no-install-recommends postgresql-15 \
    && rm -rf /var/lib/apt/lists/* \
    && mkdir -p /var/lib/postgresql/data /var/run/postgresql \
    && chown -R postgres:postgres /var/lib/postgresql /var/run/postgresql
COPY postgres-entrypoint.sh /usr/local/bin/postgres-entrypoint.sh
ENV PATH=/usr/lib/postgresql/15/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    PGDATA=/var/lib/postgresql/data
USER postgres
EXPOSE 5432
STOPSIGNAL SIGINT
ENTRYPOINT ["bash", "/usr/local/bin/postgres-entrypoint.sh"]
