# A stand-in for prom/prometheus from Debian bookworm's prometheus (2.42): the image's entrypoint is the
# prometheus binary (docker-compose.yml passes its flags as the command), data in /prometheus, wget on PATH
# for the healthcheck.
ARG DEBIAN_IMAGE=genq-local/debian:bookworm
FROM ${DEBIAN_IMAGE}
RUN apt-get update && apt-get install -y --no-install-recommends prometheus wget \
    && rm -rf /var/lib/apt/lists/* && mkdir -p /prometheus && chown nobody:nogroup /prometheus
WORKDIR /prometheus
USER nobody
EXPOSE 9090
ENTRYPOINT ["/usr/bin/prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]
