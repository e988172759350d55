# The CPU image of `cosyvoice-serve`: the torch-free server with onnxruntime's CPU build (the `cpu` and
# `serve` extras, at the versions ci/constraints.txt pins). docs/server.md's "Container" section has the commands;
# tests/test_container.py runs this file's entrypoint and health check against a live server, and builds
# and runs the image where a Docker daemon is at hand.
#
#   docker build -t cosyvoice-onnx .
#   docker run -p 50000:50000 -v /path/to/runtime-bundle:/models/bundle:ro \
#              -v cosyvoice-speakers:/data/speakers cosyvoice-onnx
#
# The official image, pinned to a patch release; give the digest too (python:...@sha256:...) for
# byte-identical rebuilds, or another base with --build-arg PYTHON_IMAGE=... (a mirror, say).
ARG PYTHON_IMAGE=python:3.11.17-slim-bookworm

# Build stage: the package into a venv, which the runtime stage copies alone (no pip cache, build
# backend or sources there). The venv lives at the same path in both stages: its scripts name its python.
FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
WORKDIR /src
COPY pyproject.toml README.md LICENSE ./
COPY ci/constraints.txt ci/
COPY graphs graphs
COPY runtime runtime
COPY export export
COPY golden golden
COPY bench bench
COPY serve serve
# then pip and setuptools leave the venv: the server needs neither (about 25 MB)
RUN /opt/venv/bin/pip install -c ci/constraints.txt '.[cpu,serve]' \
    && /opt/venv/bin/pip uninstall --yes pip setuptools

FROM ${PYTHON_IMAGE}
# The server runs as this user, which owns the speakers folder and nothing else: the venv, the embedded
# demo bundle and a mounted model are read-only to it.
RUN useradd --system --uid 10001 --user-group --create-home --home-dir /home/cosyvoice \
        --shell /usr/sbin/nologin cosyvoice \
    && mkdir -p /models /data/speakers \
    && chown cosyvoice:cosyvoice /data/speakers
COPY --from=build /opt/venv /opt/venv
COPY docker/entrypoint.sh docker/healthcheck.py /opt/cosyvoice/
# COSYVOICE_HOST: every interface, for a published port. COSYVOICE_MODEL_MOUNT: the entrypoint serves the
# runtime bundle mounted there (read-only is enough), else the embedded demo bundle; COSYVOICE_MODEL_DIR
# names another folder. COSYVOICE_PORT moves the server and its health check together (--port moves the
# server alone).
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    COSYVOICE_HOST=0.0.0.0 \
    COSYVOICE_PORT=50000 \
    COSYVOICE_MODEL_MOUNT=/models/bundle \
    COSYVOICE_SPEAKERS_DIR=/data/speakers
# registered speakers outlive the container (a new named volume takes this folder's owner)
VOLUME ["/data/speakers"]
EXPOSE 50000
USER cosyvoice
WORKDIR /home/cosyvoice
# start period: a full-size bundle takes a while to open
HEALTHCHECK --interval=30s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "/opt/cosyvoice/healthcheck.py"]
# sh runs the script, so that it needs no executable bit from the build context; the script execs the server
ENTRYPOINT ["/bin/sh", "/opt/cosyvoice/entrypoint.sh"]
