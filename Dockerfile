# The payments example (examples/payments) as a server, for docker-compose.yml. Development and CI do not need
# Docker. The image holds the library (installed from this checkout) and the example's own files, nothing else.
FROM python:3.12-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_CONSTRAINT=/app/constraints.txt
WORKDIR /app

# Pinned versions, the build backend's included (PIP_CONSTRAINT reaches pip's build environment too).
COPY examples/payments/constraints.txt ./constraints.txt
COPY pyproject.toml README.md ./
COPY idempotency_mw ./idempotency_mw
RUN pip install ".[example]"
COPY examples/__init__.py examples/dependencies.py ./examples/
COPY examples/payments ./examples/payments

USER nobody
EXPOSE 8000

# GET /healthz answers 200 while the app serves and its database answers (503 otherwise).
HEALTHCHECK --interval=10s --timeout=5s --start-period=20s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/healthz', timeout=3)"]

# --lifespan on: a startup that fails (a bad setting, no database) stops the server instead of serving errors.
# --timeout-graceful-shutdown 20: after SIGTERM, requests in flight get 20 s to finish before they are cancelled
# (and their keys released); docker-compose.yml gives the container 30 s (stop_grace_period) before SIGKILL.
CMD ["uvicorn", "examples.payments.app:app", "--host", "0.0.0.0", "--port", "8000", "--lifespan", "on", "--timeout-graceful-shutdown", "20"]
