# One image for the API (`serve`) and the GPU worker (`worker`); see docs/service.md and docker-compose.yml.
# BASE_IMAGE: any Debian-like image whose `python` is CPython 3.11 and whose `pip` may install (a mirror's copy, say).
ARG BASE_IMAGE=python:3.11-slim

# llama-cpp-python (the extra casp[gguf]: quantized GGUFs) has no wheel on PyPI: built here, with the compiler kept
# out of the image. GGML_NATIVE=OFF: code for any x86-64 CPU, not only the one that built it.
FROM ${BASE_IMAGE} AS llama-cpp
RUN apt-get update && apt-get install -y --no-install-recommends build-essential cmake \
    && rm -rf /var/lib/apt/lists/*
COPY requirements-gguf.txt constraints.txt ./
RUN CMAKE_ARGS="-DGGML_NATIVE=OFF" pip wheel --no-deps -r requirements-gguf.txt -c constraints.txt -w /wheels

FROM ${BASE_IMAGE}

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PYTHONPATH=/app \
    CASP_HOME=/data \
    HF_HOME=/data/hf

WORKDIR /app

# CUDA torch first: PyPI's Linux x86_64 torch is the CUDA build, and its nvidia-* wheels carry the CUDA runtime
# (the host needs only the driver and the NVIDIA container toolkit). TORCH_INDEX_URL picks another build, e.g.
# https://download.pytorch.org/whl/cu128. constraints.txt (the lock: every package at an exact version) pins the
# version without the +cpu label, which the CUDA build satisfies.
ARG TORCH_INDEX_URL=https://pypi.org/simple
COPY requirements.txt requirements-gguf.txt constraints.txt ./
COPY --from=llama-cpp /wheels /wheels
RUN pip install -c constraints.txt pip \
    && pip install "torch==2.13.0" --index-url "${TORCH_INDEX_URL}" \
    && pip install -r requirements.txt -r requirements-gguf.txt -c constraints.txt --find-links /wheels \
    && rm -rf /wheels

COPY alembic.ini pyproject.toml ./
COPY migrations ./migrations
COPY casp_core ./casp_core
COPY service ./service
COPY api ./api
COPY worker ./worker
COPY casp_cli ./casp_cli
COPY demo ./demo

# /data/hf exists in the image so that a volume mounted there inherits the casp owner.
RUN useradd --create-home --uid 1000 casp && mkdir -p /data/hf && chown -R casp /data
USER casp
EXPOSE 8000

# The API by default; the worker service overrides the command.
CMD ["python", "-m", "casp_cli.main", "serve", "--host", "0.0.0.0", "--port", "8000"]
