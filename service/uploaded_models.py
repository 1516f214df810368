"""Models a key uploaded, and uploads still in progress, as rows of the database."""

from collections.abc import Sequence
from datetime import datetime
from typing import Any, TypeVar

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from service.api_keys import Caller
from service.tables import (
    PendingUpload,
    UploadedModel,
    newest_first_page,
    utcnow,
)


def _sees_upload(caller: Caller) -> Any:
    return True if caller.key_id is None else UploadedModel.owner_id == caller.key_id


OwnedRow = TypeVar("OwnedRow", UploadedModel, PendingUpload)


def add_owned(session: Session, caller: Caller, table: type[OwnedRow], **fields: Any) -> OwnedRow:
    """A new uploaded model or pending upload of the caller's key."""
    row = table(owner_id=caller.key_id, created_at=utcnow(), **fields)
    session.add(row)
    session.flush()
    return row


def get_uploaded_model(session: Session, caller: Caller, model_id: str) -> UploadedModel | None:
    return session.scalar(select(UploadedModel).where(UploadedModel.id == model_id, _sees_upload(caller)))


def list_uploaded_models(
    session: Session, caller: Caller, *, limit: int, after: str | None
) -> tuple[Sequence[UploadedModel], bool]:
    """Newest first; `after` is the id of the last model of the previous page."""
    query = select(UploadedModel).where(_sees_upload(caller))
    return newest_first_page(session, UploadedModel, query, limit=limit, after=after)


def expired_uploads(session: Session, now: datetime, limit: int = 100) -> Sequence[str]:
    query = select(UploadedModel.id).where(UploadedModel.expires_at <= now)
    return session.scalars(query.order_by(UploadedModel.expires_at).limit(limit)).all()


def forget_upload(session: Session, model_id: str) -> None:
    session.execute(delete(UploadedModel).where(UploadedModel.id == model_id))


def get_pending_upload(session: Session, caller: Caller, upload_id: str) -> PendingUpload | None:
    """The caller's pending upload, not yet expired; another key's answers as a missing one."""
    query = select(PendingUpload).where(PendingUpload.id == upload_id, PendingUpload.expires_at > utcnow())
    if caller.key_id is not None:
        query = query.where(PendingUpload.owner_id == caller.key_id)
    return session.scalar(query)


def expired_pending_uploads(session: Session, now: datetime, limit: int = 100) -> Sequence[str]:
    query = select(PendingUpload.id).where(PendingUpload.expires_at <= now)
    return session.scalars(query.order_by(PendingUpload.expires_at).limit(limit)).all()


def forget_pending_upload(session: Session, upload_id: str) -> None:
    session.execute(delete(PendingUpload).where(PendingUpload.id == upload_id))
