# Python 3.11 from Debian bookworm's packages, in a virtual environment first on PATH (Debian's own python3
# refuses `pip install`, PEP 668): what the Dockerfile's BASE_IMAGE needs (python, pip, apt-get). Built by
# scripts/local_images.sh on the imported debootstrap image, where python:3.11-slim cannot be pulled.
ARG DEBIAN_IMAGE=genq-local/debian:bookworm
FROM ${DEBIAN_IMAGE}
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-pip python3-venv ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/python
# pip, requests (Hugging Face downloads) and ssl trust the system bundle (with any CA the host added), not certifi's
ENV PATH=/opt/python/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    LANG=C.UTF-8 \
    PIP_CERT=/etc/ssl/certs/ca-certificates.crt \
    REQUESTS_CA_BUNDLE=/etc/ssl/certs/ca-certificates.crt \
    SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt
CMD ["python3"]
