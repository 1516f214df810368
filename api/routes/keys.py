"""/v1/keys/me: what the calling key holds of its own: its hub token, set or cleared, never read back."""

from fastapi import APIRouter, HTTPException, Response, status

from api.deps import CallerDep, SessionDep, SettingsDep
from api.errors import responses
from api.json_body import JsonRoute
from api.schemas import HubTokenIn
from service import api_keys
from service.security import encrypt_hub_token

router = APIRouter(prefix="/v1/keys/me", tags=["keys"], responses=responses(400, 401, 422), route_class=JsonRoute)


def own_key_id(caller: api_keys.Caller) -> str:
    if caller.key_id is None:
        raise HTTPException(
            status.HTTP_400_BAD_REQUEST, "this server runs without API keys (CASP_AUTH=none): no key holds a hub token"
        )
    return caller.key_id


@router.put("/hub-token", status_code=status.HTTP_204_NO_CONTENT)
def set_hub_token(body: HubTokenIn, session: SessionDep, caller: CallerDep, settings: SettingsDep) -> Response:
    """Stores the key's Hugging Face token, encrypted with the server's secret, for this key's jobs only (a
    private repository as `model`); it replaces the one before. It is never answered back, by this or any route."""
    api_keys.set_hub_token(session, own_key_id(caller), encrypt_hub_token(settings.verification_keys, body.token))
    session.commit()
    return Response(status_code=status.HTTP_204_NO_CONTENT)


@router.delete("/hub-token", status_code=status.HTTP_204_NO_CONTENT)
def clear_hub_token(session: SessionDep, caller: CallerDep) -> Response:
    """Removes the key's hub token (no error when it has none): its jobs then load hub models without one."""
    api_keys.set_hub_token(session, own_key_id(caller), None)
    session.commit()
    return Response(status_code=status.HTTP_204_NO_CONTENT)
