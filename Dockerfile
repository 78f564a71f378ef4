# Tally: one image for the API service, the training hosts and the Beam jobs.
FROM python:3.11-slim
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 JAX_PLATFORMS=cpu
WORKDIR /app
COPY pyproject.toml README.md ./
COPY audit ./audit
COPY pipeline ./pipeline
COPY trainer ./trainer
COPY api ./api
RUN pip install --no-cache-dir '.[all]'
WORKDIR /data
ENTRYPOINT ["tally"]
CMD ["--help"]
