"""API keys, signed download URLs, and the keys' hub tokens encrypted at rest."""

import base64
import hashlib
import hmac
import secrets
import time
from collections.abc import Sequence

from cryptography.fernet import Fernet, InvalidToken, MultiFernet
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from casp_core.errors import CaspError

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


# The server secret signs download URLs too: hub tokens are encrypted with a key derived from it for this use alone.
HUB_TOKEN_KEY_INFO = b"casp hub tokens"


class HubTokenUnreadable(CaspError):
    """A stored hub token that none of the server's secrets decrypts (the secret it was stored with was dropped)."""

    code = "hub_token_unreadable"


def _hub_token_cipher(secrets: Sequence[bytes]) -> MultiFernet:
    """Encrypts with the first secret's key; decrypts with any of them, so a rotated secret (CASP_SECRET_KEY moved to
    CASP_PREVIOUS_SECRET_KEYS) still reads the tokens stored before."""
    keys = [HKDF(hashes.SHA256(), 32, salt=None, info=HUB_TOKEN_KEY_INFO).derive(secret) for secret in secrets]
    return MultiFernet([Fernet(base64.urlsafe_b64encode(key)) for key in keys])


def encrypt_hub_token(secrets: Sequence[bytes], token: str) -> str:
    return _hub_token_cipher(secrets).encrypt(token.encode()).decode()


def decrypt_hub_token(secrets: Sequence[bytes], stored: str) -> str:
    try:
        return _hub_token_cipher(secrets).decrypt(stored.encode()).decode()
    except InvalidToken:
        raise HubTokenUnreadable(
            "the key's hub token cannot be decrypted with the server's CASP_SECRET_KEY or CASP_PREVIOUS_SECRET_KEYS;"
            " set it again (casp keys set-hub-token)"
        ) from None
