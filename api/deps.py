"""Request dependencies: settings, a database session, storage, the dispatcher and the caller's identity."""

from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, HTTPException, Request, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session

from service import api_keys
from service.db import session_factory
from service.dispatch import Dispatcher
from service.logs import add_log_context
from service.settings import Settings
from service.storage import Storage


def get_settings(request: Request) -> Settings:
    return request.app.state.settings


def get_storage(request: Request) -> Storage:
    return request.app.state.storage


def get_dispatcher(request: Request) -> Dispatcher:
    return request.app.state.dispatcher


def get_session(settings: Annotated[Settings, Depends(get_settings)]) -> Iterator[Session]:
    """Routes commit what they write; anything uncommitted is rolled back when the request ends."""
    with session_factory(settings.database)() as session:
        yield session


SettingsDep = Annotated[Settings, Depends(get_settings)]
SessionDep = Annotated[Session, Depends(get_session)]
StorageDep = Annotated[Storage, Depends(get_storage)]
DispatcherDep = Annotated[Dispatcher, Depends(get_dispatcher)]


# Declared as an HTTP bearer scheme so that the OpenAPI document (and /docs) knows how to send the key;
# auto_error=False: a missing key is answered below, in the service's own error shape.
api_key_scheme = HTTPBearer(auto_error=False, description="an API key from `casp keys create`")


def get_caller(
    settings: SettingsDep,
    session: SessionDep,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(api_key_scheme)],
) -> api_keys.Caller:
    if settings.auth == "none":
        return api_keys.Caller(key_id=None)
    token = credentials.credentials.strip() if credentials else ""
    key = api_keys.find_api_key(session, token) if token else None
    if key is None:
        raise HTTPException(
            status.HTTP_401_UNAUTHORIZED,
            "a valid API key is required: Authorization: Bearer <key>",
            headers={"WWW-Authenticate": "Bearer"},
        )
    add_log_context(key_name=key.name)
    return api_keys.Caller(key_id=key.id)


CallerDep = Annotated[api_keys.Caller, Depends(get_caller)]
