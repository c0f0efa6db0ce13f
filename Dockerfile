# The planner's solver service (`planner serve`): solves posted activation graphs; needs no torch.
#   docker build -t planner-service .            (or: podman build --format docker -t planner-service .)
#   docker run -p 8000:8000 -v planner-data:/data planner-service
# Replicas on PostgreSQL instead of SQLite in /data: compose.yaml (PLANNER_DB=postgresql://...).
# Build with --build-arg WITH_TORCH=1 to add torch (for running PlannerClient.optimize in the image).
FROM python:3.11-slim

ARG WITH_TORCH=0
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PLANNER_DB=/data/jobs.sqlite3

RUN useradd --create-home --uid 10001 --shell /usr/sbin/nologin planner \
    && mkdir -p /data /app && chown planner:planner /data

WORKDIR /app
COPY pyproject.toml README.md ./
COPY planner ./planner
# api/ installs as the package planner_service (pyproject.toml's package-dir), not as a top-level api
COPY api ./api

# The project without its torch dependency, then the `service` extra read from pyproject.toml (one list).
RUN python -c "import tomllib; extras = tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']; print('\n'.join(extras['service']))" > /tmp/service-requirements.txt \
    && pip install --no-deps . \
    && pip install -r /tmp/service-requirements.txt \
    && if [ "$WITH_TORCH" = "1" ]; then pip install "torch==2.13.0"; fi \
    && rm -rf /tmp/service-requirements.txt /root/.cache

USER planner
VOLUME ["/data"]
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=10s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/healthz', timeout=4)"]
CMD ["planner", "serve", "--host", "0.0.0.0", "--port", "8000"]
