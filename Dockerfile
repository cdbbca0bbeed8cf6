# syntax=docker/dockerfile:1.7
# Cairn images. Targets:
#   docker build --target operator -t cairn-operator:dev .   (kopf operator, no torch)
#   docker build --target trainer  -t cairn-trainer:dev .    (torch, writer, reference trainer)
# Without a daemon: scripts/build-images (buildah, a local Debian base passed as
# PYTHON_IMAGE; docs/images.md). Base pinned by version; both run as the
# unprivileged user 65532. Dependencies come from requirements.lock (versions
# and hashes); the devcluster is not in either image.

ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm

# The pinned uv (scripts/uv.txt, hashes checked) and the cairn-training wheel.
FROM ${PYTHON_IMAGE} AS wheel
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 UV_PYTHON_DOWNLOADS=never UV_NO_CACHE=1
WORKDIR /src
COPY scripts/uv.txt ./scripts/uv.txt
RUN pip install --require-hashes --target /tools -r scripts/uv.txt
COPY pyproject.toml README.md requirements.lock ./
COPY api ./api
COPY operator ./operator
COPY trainer_image ./trainer_image
COPY plugin ./plugin
RUN /tools/bin/uv build --wheel --out-dir /wheels .

# One virtualenv per target, installed from the lock: `-c requirements.lock`
# pins every version, and uv checks each download against the lock's hashes.
FROM wheel AS operator-env
RUN python -m venv --without-pip /opt/cairn \
 && /tools/bin/uv pip install --python /opt/cairn/bin/python -c requirements.lock \
      "$(ls /wheels/cairn_training-*.whl)[operator]"

FROM wheel AS trainer-env
RUN python -m venv --without-pip /opt/cairn \
 && /tools/bin/uv pip install --python /opt/cairn/bin/python -c requirements.lock \
      "$(ls /wheels/cairn_training-*.whl)[trainer,ray]"

FROM ${PYTHON_IMAGE} AS runtime-base
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PATH=/opt/cairn/bin:$PATH
RUN groupadd --gid 65532 cairn && useradd --uid 65532 --gid 65532 --no-create-home cairn

FROM runtime-base AS operator
COPY --from=operator-env /opt/cairn /opt/cairn
USER 65532:65532
ENTRYPOINT ["python", "-m", "cairn.operator"]

FROM runtime-base AS trainer
COPY --from=trainer-env /opt/cairn /opt/cairn
USER 65532:65532
WORKDIR /workspace
ENTRYPOINT ["torchrun"]
