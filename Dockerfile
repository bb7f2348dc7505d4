# rolltap in a container. Two variants from one file, chosen by a build argument:
#   docker build -t rolltap .                            # CPU: vLLM's CPU build, runs `rolltap demo`
#   docker build --build-arg VARIANT=gpu -t rolltap:gpu .  # GPU: the `gpu` extra (CUDA vLLM)
# The build stage compiles and installs; the runtime stage carries only the virtualenv, the
# sources it was installed from (the demo reads examples/ beside them) and bubblewrap, and runs
# as an unprivileged user.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS base
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/rolltap/venv \
    PATH=/opt/rolltap/venv/bin:$PATH

FROM base AS build
# cpu | gpu: which vLLM extra to install.
ARG VARIANT=cpu
# vLLM's CPU build pins a +cpu torch, published on PyTorch's CPU index.
ARG TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc g++ libc6-dev \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /opt/rolltap/src
COPY pyproject.toml README.md ./
COPY core core
COPY gateway gateway
COPY trainer_bridge trainer_bridge
COPY sandbox sandbox
COPY stack stack
COPY examples examples
# torchvision, torchaudio and torchcodec come with the CPU build but do not match its torch and
# break transformers' imports (see the Makefile); text models need none of them.
RUN python -m venv "$VIRTUAL_ENV" \
    && if [ "$VARIANT" = cpu ]; then export PIP_EXTRA_INDEX_URL="$TORCH_CPU_INDEX"; fi \
    && pip install -e ".[${VARIANT},train,export]" \
    && if [ "$VARIANT" = cpu ]; then pip uninstall -y torchvision torchaudio torchcodec; fi

FROM base AS runtime
# bubblewrap confines sandboxed agents (own PID, mount and network namespaces).
RUN apt-get update \
    && apt-get install -y --no-install-recommends bubblewrap \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --create-home --uid 10001 --shell /usr/sbin/nologin rolltap
COPY --from=build /opt/rolltap /opt/rolltap
USER 10001:10001
WORKDIR /home/rolltap
ENV ROLLTAP_PORT=9000
EXPOSE 9000
# Healthy once the gateway answers /healthz with its database and a vLLM replica up (the demo
# builds a model and starts vLLM first, hence the long start period).
HEALTHCHECK --interval=30s --timeout=5s --start-period=600s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:' + os.environ.get('ROLLTAP_PORT', '9000') + '/healthz', timeout=4)"]
CMD ["rolltap", "demo", "--dir", "/home/rolltap/runs/demo", "--gateway-port", "9000"]
