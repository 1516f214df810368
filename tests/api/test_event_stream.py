"""`GET /v1/jobs/{id}/events?stream=true`: Server-Sent Events, resumable, ending with the job; the OpenAPI
document shows it. (That events arrive as they happen, through `casp_cli.client`, is in tests/cli/test_embedded.)"""

import json

import pytest
from fastapi.testclient import TestClient

from api.routes.jobs import last_event_id
from api.schemas import MAX_EVENT_ID
from tests.api.test_api import PARKED

pytestmark = pytest.mark.service


def parse(stream: str) -> list[dict[str, str]]:
    """The events of an SSE body: blocks of `field: value` lines parted by blank lines, comments left out."""
    events = []
    for block in stream.replace("\r\n", "\n").split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.splitlines() if line and not line.startswith(":"))
        if fields:
            events.append(fields)
    return events


def test_the_events_of_a_finished_job_stream_and_the_stream_ends(
    api: TestClient, keys: dict[str, dict[str, str]]
) -> None:
    alice = keys["alice"]
    job = api.post("/v1/jobs", json=PARKED, headers=alice).json()
    api.post(f"/v1/jobs/{job['id']}/cancel", headers=alice)
    paged = api.get(f"/v1/jobs/{job['id']}/events", headers=alice).json()["data"]

    response = api.get(f"/v1/jobs/{job['id']}/events", params={"stream": "true"}, headers=alice)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    streamed = parse(response.text)
    assert [json.loads(e["data"]) for e in streamed] == paged
    assert [e["id"] for e in streamed] == [str(e["id"]) for e in paged]
    assert [e["event"] for e in streamed] == ["status", "status"]  # queued, cancelled

    # Taken up again after the last event a client saw (the header a reconnecting EventSource sends).
    resumed = api.get(
        f"/v1/jobs/{job['id']}/events",
        params={"stream": "true"},
        headers={**alice, "Last-Event-ID": streamed[0]["id"]},
    )
    assert [json.loads(e["data"])["message"] for e in parse(resumed.text)] == ["cancelled"]
    # An id that is no event id starts from the beginning, as the SSE specification has a client do.
    for unusable in ("null", "", "-1", "abc", str(2**64)):
        restarted = api.get(
            f"/v1/jobs/{job['id']}/events", params={"stream": "true"}, headers={**alice, "Last-Event-ID": unusable}
        )
        assert restarted.status_code == 200 and [e["id"] for e in parse(restarted.text)] == [e["id"] for e in streamed]
    # Another key's job answers 404 as on every route.
    assert api.get(f"/v1/jobs/{job['id']}/events?stream=true", headers=keys["bob"]).status_code == 404


def test_the_openapi_document_shows_the_stream(api: TestClient) -> None:
    operation = api.get("/openapi.json").json()["paths"]["/v1/jobs/{job_id}/events"]["get"]
    content = operation["responses"]["200"]["content"]
    # The stream is text whose items are the events, each carrying an EventOut as JSON; the page is JSON.
    assert content["text/event-stream"]["schema"] == {"type": "string", "contentMediaType": "text/event-stream"}
    data = content["text/event-stream"]["itemSchema"]["properties"]["data"]
    assert data["contentSchema"] == {"$ref": "#/components/schemas/EventOut"}
    assert content["application/json"]["schema"] == {"$ref": "#/components/schemas/EventList"}
    assert "stream" in [p["name"] for p in operation["parameters"]]
    assert "429" in operation["responses"]
    last_event_id = next(p for p in operation["parameters"] if p["name"] == "Last-Event-ID")
    assert last_event_id["schema"]["anyOf"][0]["type"] == "string"


def test_an_event_id_is_ascii_digits_within_a_bigint() -> None:
    # `²` is a digit to str.isdigit but no number to int; `٣` is one to both, but no id a server sent.
    assert [last_event_id(value) for value in ("7", " 7 ", "²", "٣", str(MAX_EVENT_ID), str(MAX_EVENT_ID + 1))] == [
        7,
        7,
        None,
        None,
        MAX_EVENT_ID,
        None,
    ]
