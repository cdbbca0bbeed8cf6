# syntax=docker/dockerfile:1.7
# Cairn images. Targets:
#   docker build --target operator -t cairn-operator:dev .   (kopf operator, no torch)
#   docker build --target trainer  -t cairn-trainer:dev .    (torch, writer, reference trainer)
# Base pinned by version; both run as the unprivileged user 65532.

ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm

FROM ${PYTHON_IMAGE} AS wheel
WORKDIR /src
RUN pip install --no-cache-dir build==1.2.2.post1
COPY pyproject.toml README.md ./
COPY api ./api
COPY operator ./operator
COPY trainer_image ./trainer_image
COPY devcluster/cairn ./devcluster/cairn
RUN python -m build --wheel --outdir /wheels .

FROM ${PYTHON_IMAGE} AS runtime-base
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
RUN groupadd --gid 65532 cairn && useradd --uid 65532 --gid 65532 --no-create-home cairn

FROM runtime-base AS operator
COPY --from=wheel /wheels /wheels
RUN pip install "$(ls /wheels/cairn-*.whl)[operator]" && rm -rf /wheels
USER 65532:65532
ENTRYPOINT ["python", "-m", "cairn.operator"]

FROM runtime-base AS trainer
COPY --from=wheel /wheels /wheels
RUN pip install "$(ls /wheels/cairn-*.whl)[trainer]" && rm -rf /wheels
USER 65532:65532
WORKDIR /workspace
ENTRYPOINT ["torchrun"]
