"""API keys and signed download URLs."""

import hashlib
import hmac
import secrets
import time
from collections.abc import Sequence

KEY_PREFIX = "casp_"


def new_api_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def hash_api_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def _signature(secret: bytes, job_id: str, name: str, expires: int) -> str:
    message = f"{job_id}\n{name}\n{expires}".encode()
    return hmac.new(secret, message, hashlib.sha256).hexdigest()


def sign_download(secret: bytes, job_id: str, name: str, ttl_seconds: int) -> tuple[int, str]:
    """(expires, signature) for one artifact of one job."""
    expires = int(time.time()) + ttl_seconds
    return expires, _signature(secret, job_id, name, expires)


def verify_download(secrets: Sequence[bytes], job_id: str, name: str, expires: int, signature: str) -> bool:
    """Whether one of `secrets` (the current one and those it replaced) signed this unexpired link."""
    if expires < time.time():
        return False
    # Compared as bytes: compare_digest refuses str with non-ASCII characters, and a signature is the caller's.
    given = signature.encode()
    return any(hmac.compare_digest(_signature(secret, job_id, name, expires).encode(), given) for secret in secrets)
