# A stand-in for redis:7 from Debian bookworm's redis (7.0): redis-server and redis-cli on PATH, data in /data.
ARG DEBIAN_IMAGE=genq-local/debian:bookworm
FROM ${DEBIAN_IMAGE}
RUN apt-get update && apt-get install -y --no-install-recommends redis-server redis-tools \
    && rm -rf /var/lib/apt/lists/* && mkdir -p /data && chown redis:redis /data
WORKDIR /data
USER redis
EXPOSE 6379
# as redis:7's entrypoint does: redis-server started with no config file listens on every address of the
# container, and --protected-mode no lets the other containers in without a password
ENTRYPOINT ["sh", "-c", "if [ \"$1\" = redis-server ]; then shift; exec redis-server \"$@\" --protected-mode no; fi; exec \"$@\"", "--"]
CMD ["redis-server"]
