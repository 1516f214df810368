"""/v1/usage: what the calling key uses against its limits, and the storage its jobs' artifacts take."""

from fastapi import APIRouter

from api.deps import CallerDep, SessionDep, SettingsDep
from api.errors import responses
from api.schemas import LimitsOut, UsageOut
from service import api_keys
from service.tables import ApiKey

router = APIRouter(prefix="/v1/usage", tags=["usage"], responses=responses(401, 422))


@router.get("", response_model=UsageOut)
def get_usage(session: SessionDep, caller: CallerDep, settings: SettingsDep) -> UsageOut:
    limits = api_keys.limits_of(session, caller, settings)
    key = session.get(ApiKey, caller.key_id) if caller.key_id else None
    used = api_keys.usage_of(session, caller)
    return UsageOut(
        key_name=key.name if key else None,
        limits=LimitsOut(**vars(limits)) if limits else None,
        active_jobs=used.active_jobs,
        submissions_last_minute=used.submissions_last_minute,
        storage_bytes=used.storage_bytes,
        artifact_files=used.artifact_files,
    )
