# One image for every role; the service's command picks the role.
# Base: the official PyTorch CUDA runtime, so torch is not downloaded again by pip.
FROM pytorch/pytorch:2.6.0-cuda12.4-cudnn9-runtime
WORKDIR /opt/dflash
COPY pyproject.toml README.md ./
COPY dflash_ns dflash_ns
COPY protocol protocol
COPY runtime runtime
COPY broker broker
COPY producers producers
COPY consumers consumers
COPY decoding decoding
COPY tools tools
RUN pip install --no-cache-dir .
ENV DFLASH_RUNS_DIR=/runs PYTHONUNBUFFERED=1
VOLUME ["/runs"]
EXPOSE 5555 5556 5557-5564
