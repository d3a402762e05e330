# One image for every service (api, worker, beat, flower, migrate); docker-compose.yml picks the command.
# The CPU build of torch by default; for a GPU worker build with
#   --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126
FROM python:3.11-slim

ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HOME=/home/genq/.cache/huggingface

WORKDIR /app

# a C++ compiler: the engine builds its CPU paged-attention kernel on first use (without one it
# falls back to the slower torch path and says so in the log)
RUN apt-get update && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*

# torch first: the largest layer, rebuilt only when TORCH_INDEX_URL changes
RUN pip install --index-url "$TORCH_INDEX_URL" "torch>=2.4"

# then the dependencies (from pyproject.toml alone, so code changes do not reinstall them) ...
COPY pyproject.toml README.md ./
RUN mkdir batching jobstore webapi workers \
    && pip install . \
    && pip uninstall -y genq

# ... then the code
COPY . .
RUN pip install --no-deps . \
    && useradd --create-home --uid 1000 genq

USER genq
EXPOSE 8000 5555
CMD ["gunicorn", "--bind", "0.0.0.0:8000", "webapi:create_app()"]
