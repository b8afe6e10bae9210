# The payments example as a server, for docker-compose.yml. Development and CI do not need Docker.
FROM python:3.12-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY idempotency_mw ./idempotency_mw
RUN pip install --no-cache-dir ".[example]"
COPY examples/__init__.py ./examples/__init__.py
COPY examples/payments ./examples/payments
USER nobody
EXPOSE 8000
CMD ["uvicorn", "examples.payments.app:app", "--host", "0.0.0.0", "--port", "8000"]
