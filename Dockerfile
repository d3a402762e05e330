# One image for every service (api, worker, beat, flower, migrate); docker-compose.yml picks the command.
# The CPU build of torch by default; docker-compose.yml builds the GPU worker's image with
#   --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126   (a CUDA build of torch)
# BASE_IMAGE: any Debian-based image with Python 3.11, pip and apt-get first on PATH (e.g. genq-local/python:3.11,
# built from Debian's packages by scripts/local_images.sh where no image registry is reachable)
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HOME=/home/genq/.cache/huggingface \
    GENQ_KERNEL_CACHE=/home/genq/.cache/genq \
    TRITON_CACHE_DIR=/home/genq/.cache/triton

WORKDIR /app

# a C++ compiler: the engine builds its CPU paged-attention kernel on first use (without one it
# falls back to the slower torch path and says so in the log)
RUN apt-get update && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*

# the user, and the caches it writes (models, the CPU kernel), made before a volume mounts on them so
# that the volume starts owned by genq, not root
RUN useradd --create-home --uid 1000 genq \
    && mkdir -p "$HF_HOME" "$GENQ_KERNEL_CACHE" "$TRITON_CACHE_DIR" \
    && chown -R genq:genq /home/genq/.cache

# (the build arguments come after the steps above, which every image shares: an argument's value is part of the
# cache key of each RUN after it)
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG TORCH_FIND_LINKS=
ARG TORCH_VERSION=2.13.0
# pyproject.toml extras to install: "api" makes the API's image (no torch), "api,worker" the image of
# everything else (worker, beat, flower, migrate)
ARG EXTRAS=api,worker
# torch first (worker images only): the largest layer, rebuilt only when TORCH_INDEX_URL changes. TORCH_FIND_LINKS
# (a directory or URL of wheels, e.g. the CPU wheel served from the host: scripts/compose_smoke.sh) installs torch
# from there alone, without its dependencies (the lock's step below brings them), where the index is unreachable
RUN case ",$EXTRAS," in *,worker,*) \
        if [ -n "$TORCH_FIND_LINKS" ]; then \
            case "$TORCH_FIND_LINKS" in http://*) host=${TORCH_FIND_LINKS#http://}; set -- --trusted-host "${host%%[:/]*}" ;; esac; \
            pip install --no-index --no-deps --find-links "$TORCH_FIND_LINKS" "$@" "torch==$TORCH_VERSION"; \
        else \
            pip install --index-url "$TORCH_INDEX_URL" "torch==$TORCH_VERSION"; \
        fi ;; \
    esac

# then the dependencies (from pyproject.toml alone, so code changes do not reinstall them) through the lock,
# less its torch and triton pins: constraints.txt is resolved against the CPU build of torch, and a CUDA build
# brings the triton it was built with (pinning the lock's would make the install unresolvable)
COPY pyproject.toml README.md constraints.txt ./
RUN mkdir batching jobstore webapi workers \
    && grep -vE '^(torch|triton)==' constraints.txt > /tmp/constraints-image.txt \
    && pip install -c /tmp/constraints-image.txt ".[$EXTRAS]" \
    && pip uninstall -y genq && rm /tmp/constraints-image.txt

# ... then the code
COPY . .
RUN pip install --no-deps .

USER genq
EXPOSE 8000 5555
CMD ["gunicorn", "--bind", "0.0.0.0:8000", "webapi:create_app()"]
