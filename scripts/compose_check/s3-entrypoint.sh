#!/bin/sh
# `s3-entrypoint.sh server DIR`: SeaweedFS with its S3 API on :9000, one identity from MINIO_ROOT_USER/PASSWORD.
# `s3-entrypoint.sh make-bucket ENDPOINT NAME`: creates the bucket (if missing) once the server answers.
set -eu
case "$1" in
server)
  mkdir -p "$2"
  cat > /tmp/s3.json <<JSON
{"identities": [{"name": "root", "credentials": [{"accessKey": "$MINIO_ROOT_USER", "secretKey": "$MINIO_ROOT_PASSWORD"}],
  "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}
JSON
  exec weed server -dir="$2" -master.telemetry=false -volume.max=30 -master.volumeSizeLimitMB=64 \
    -filer -s3 -s3.port=9000 -s3.port.iceberg=0 -s3.port.lance=0 -s3.config=/tmp/s3.json
  ;;
make-bucket)
  exec python - "$2" "$3" <<'PY'
import os, sys, time
import boto3
endpoint, bucket = sys.argv[1:]
client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                      aws_access_key_id=os.environ["MINIO_ROOT_USER"],
                      aws_secret_access_key=os.environ["MINIO_ROOT_PASSWORD"])
for attempt in range(60):
    try:
        client.create_bucket(Bucket=bucket)
        break
    except client.exceptions.BucketAlreadyOwnedByYou:
        break
    except Exception as error:  # the server is still starting
        print(f"waiting for {endpoint}: {error}", flush=True)
        time.sleep(1)
else:
    sys.exit(f"could not create bucket {bucket} at {endpoint}")
print(f"bucket {bucket} ready")
PY
  ;;
*)
  exec "$@"
  ;;
esac
