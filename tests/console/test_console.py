"""The console (api/console) in a real browser: Chromium from Debian's packages, driven by Playwright, against the
embedded service on a loopback port (SQLite, local storage, one worker thread, API keys on), running real jobs on
stories260K: one submitted through the form and run to the end, two cancelled while they run (LoRA recovery that
lasts until cancelled), one that fails at once, one cancelled before it starts.
The tests take screenshots of the list, a job and the form; `make screenshots` runs them with
CASP_CONSOLE_SCREENSHOTS=docs/console, which writes the ones the README shows (elsewhere they go to a scratch
folder, so that `make test` leaves the tree as it was)."""

import hashlib
import os
import re
import tempfile
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
from playwright.sync_api import Browser, BrowserContext, Locator, Page, Playwright, Route, expect, sync_playwright

from casp_cli.app import service_app
from casp_core.job.sweep.run import Point, Target, first_perplexity, on_front
from casp_core.report.frontier_section import render_frontier_section
from casp_core.settings import PruneConfig
from service import api_keys
from service.db import session_scope
from service.settings import Settings
from tests.service_fixtures import RUNS_UNTIL_CANCELLED, TINY_JOB, embedded_settings, finished, serving, wait_for
from worker.runner import RECOVERY_SUMMARY, summary_of

pytestmark = pytest.mark.service

CHROMIUM = "/usr/bin/chromium"
# This machine's network is closed: no background connections, which would only time out.
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
SCREENSHOTS = Path(os.environ.get("CASP_CONSOLE_SCREENSHOTS") or tempfile.mkdtemp(prefix="casp-console-"))
JOB_SECONDS = 180_000  # ms, Playwright's unit: a real job on a busy 2-core machine
# Every stage of a ratio job, in the order the worker runs them (the placement is an event of the evaluation).
STAGES = ["load", "calibration", "evaluation", "placement", "allocation", "pruning", "verification", "checkpoint",
          "report", "upload"]  # fmt: skip


@pytest.fixture(scope="module")
def settings(tmp_path_factory: pytest.TempPathFactory) -> Settings:
    home = tmp_path_factory.mktemp("console-home")
    return embedded_settings(home, auth="apikey", embedded_workers=1, default_device="cpu")


@pytest.fixture(scope="module")
def keys(settings: Settings) -> dict[str, str]:
    with session_scope(settings.database) as session:
        return {name: api_keys.create_api_key(session, name)[1] for name in ("alice", "bob")}


@pytest.fixture(scope="module")
def server(settings: Settings) -> Iterator[str]:
    with serving(service_app(settings)) as url:
        yield url


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    assert Path(CHROMIUM).exists(), f"no {CHROMIUM}: apt-get install chromium (.ci/run does)"
    with sync_playwright() as playwright:
        browser = launch(playwright)
        yield browser
        browser.close()


def launch(playwright: Playwright) -> Browser:
    return playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)


@pytest.fixture
def context(browser: Browser, server: str) -> Iterator[BrowserContext]:
    """A fresh tab's worth of state (sessionStorage, downloads), whose every request is logged: at the end, none
    may have gone anywhere but the server's own origin."""
    context = browser.new_context(viewport={"width": 1280, "height": 900}, accept_downloads=True)
    requests: list[str] = []
    context.on("request", lambda request: requests.append(request.url))
    yield context
    context.close()
    origin = urlsplit(server).netloc
    assert requests, "no request was logged"
    foreign = [
        url for url in requests if urlsplit(url).scheme not in ("data", "blob") and urlsplit(url).netloc != origin
    ]
    assert not foreign, f"requests left {origin}: {foreign}"


@pytest.fixture
def page(context: BrowserContext) -> Iterator[Page]:
    """A page whose scripts must throw nothing uncaught."""
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.set_default_timeout(20_000)
    yield page
    assert not errors, errors


# Every state of the button `selector` names from now on, into window.buttonStates.
BUTTON_STATES_RECORDER = """selector => {
  const button = document.querySelector(selector);
  const record = () =>
    window.buttonStates.push({text: button.textContent, disabled: button.disabled, hidden: button.hidden});
  window.buttonStates = [];
  new MutationObserver(record).observe(button, {attributes: true, childList: true, characterData: true, subtree: true});
}"""


def sign_in(page: Page, url: str, key: str) -> None:
    """Opens `url` and enters the key in the form the console asks for it with."""
    page.goto(url)
    page.get_by_label("API key").fill(key)
    page.get_by_role("button", name="Use this key").click()
    expect(page.locator("main")).to_be_visible()


def api_get(server: str, key: str, path: str) -> Any:
    response = httpx.get(f"{server}{path}", headers={"Authorization": f"Bearer {key}"}, timeout=30)
    response.raise_for_status()
    return response.json()


def api_post(server: str, key: str, path: str, body: dict[str, Any] | None = None) -> Any:
    response = httpx.post(f"{server}{path}", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=30)
    response.raise_for_status()
    return response.json()


def screenshot(page: Page, name: str, height: int = 900) -> None:
    """The page's top `height` pixels into SCREENSHOTS, as the README shows them."""
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    clip = {"x": 0, "y": 0, "width": page.viewport_size["width"], "height": height}
    page.screenshot(path=str(SCREENSHOTS / name), full_page=True, clip=clip)


def form_field(page: Page, path: str) -> Locator:
    """The form's input for `path` (`calibration.n_samples`), Advanced opened first when it is folded there."""
    field = page.locator(f'[data-field="{path}"]')
    folded = page.locator("details:not([open])", has=field)
    if folded.count():
        folded.locator("summary").first.click()
    name = path.rpartition(".")[2]
    return field.get_by_label(re.compile(f"^{name}( \\(required\\))?$"))


def fill_field(page: Page, path: str, value: str) -> None:
    form_field(page, path).fill(value)


def hold_load(route: Route, loads: list[str]) -> None:
    loads.append(route.request.url)
    time.sleep(1)
    route.continue_()


def test_a_job_submitted_through_the_form_runs_to_its_report_and_checkpoint(
    page: Page, server: str, keys: dict[str, str], tmp_path: Path
) -> None:
    sign_in(page, f"{server}/console/new", keys["alice"])
    fill_field(page, "model", TINY_JOB["model"])
    fill_field(page, "ratio", "0.3")
    fill_field(page, "calibration.dataset", "wikitext2:validation")
    fill_field(page, "calibration.n_samples", "2")
    fill_field(page, "calibration.seq_len", "32")
    fill_field(page, "evaluation.perplexity", "wikitext2")
    fill_field(page, "evaluation.seq_len", "32")
    fill_field(page, "evaluation.zero_shot", "arc_easy")
    fill_field(page, "evaluation.limit", "2")
    fill_field(page, "metadata", "source=console test")
    jobs_before = len(api_get(server, keys["alice"], "/v1/jobs")["data"])
    posts: list[dict[str, str]] = []
    page.on("request", lambda r: posts.append(r.headers) if r.method == "POST" and r.url.endswith("/v1/jobs") else None)
    # The job page's load is held a second, so that the second click's answer comes while the first answer's
    # navigation is under way (as it may on a busy machine): the page must not navigate again, which would abort
    # the first navigation (net::ERR_ABORTED in wait_for_url).
    loads: list[str] = []
    page.route(re.compile(r"/console/jobs/[0-9a-f]{32}$"), lambda route: hold_load(route, loads))
    page.get_by_role("button", name="Submit the job").dblclick()
    page.wait_for_url(re.compile(r"/console/jobs/[0-9a-f]{32}$"))
    page.unroute(re.compile(r"/console/jobs/[0-9a-f]{32}$"))
    job_id = page.url.rsplit("/", 1)[1]

    # Two requests, one key: one job, and one navigation to it.
    assert len(posts) == 2 and posts[0]["idempotency-key"] == posts[1]["idempotency-key"], posts
    assert loads == [f"{server}/console/jobs/{job_id}"], loads
    listed = api_get(server, keys["alice"], "/v1/jobs")["data"]
    assert len(listed) == jobs_before + 1 and listed[0]["id"] == job_id
    assert listed[0]["metadata"] == {"source": "console test"}
    assert listed[0]["settings"]["calibration"]["n_samples"] == 2

    # The stages advance from the event stream while the page is open (one running at a time), then all show done.
    expect(page.locator('#stages li[data-state="running"]')).to_have_count(1, timeout=JOB_SECONDS)
    expect(page.locator("#status")).to_have_text("succeeded", timeout=JOB_SECONDS)
    expect(page.locator("#stages li")).to_have_count(len(STAGES))
    assert page.locator("#stages li").evaluate_all("items => items.map(i => i.dataset.stage)") == STAGES
    assert set(page.locator("#stages li").evaluate_all("items => items.map(i => i.dataset.state)")) == {"done"}
    expect(page.locator("#events tbody tr").last).to_contain_text("succeeded")
    expect(page.locator("#cancel")).to_be_hidden()

    # The result, dense against pruned, as the API reports it.
    job = api_get(server, keys["alice"], f"/v1/jobs/{job_id}")
    ppl = job["result"]["perplexity"]["wikitext2"]
    perplexity_row = page.locator("#summary tr", has_text="perplexity wikitext2")
    expect(perplexity_row).to_contain_text(f"{ppl['dense']:.3f}")
    expect(perplexity_row).to_contain_text(f"{ppl['pruned']:.3f}")
    accuracy = job["result"]["zero_shot"]["arc_easy"]
    accuracy_row = page.locator("#summary tr", has_text="accuracy arc_easy (2 documents)")
    expect(accuracy_row.locator("td").nth(0)).to_have_text(f"{accuracy['dense']:.3f}")
    expect(accuracy_row.locator("td").nth(1)).to_have_text(f"{accuracy['pruned']:.3f}")
    expect(page.locator("#facts")).to_contain_text(f"{job['result']['achieved_ratio']:.4f}")

    # report.md rendered: its perplexity table (dense, pruned and their ratio per data set), the per-layer table,
    # and its plots, loaded from the artifacts' signed links.
    report = page.locator("#report")
    perplexity_table = report.locator("table", has=page.locator("th", has_text="pruned / dense"))
    expect(perplexity_table.locator("tbody tr")).to_have_count(1)
    expect(perplexity_table.locator("tbody tr")).to_contain_text(f"{ppl['pruned']:.3f}")
    layers_table = report.locator("table", has=page.locator("th", has_text="heads pruned"))
    expect(layers_table.locator("tbody tr")).to_have_count(5)  # stories260K's five layers
    plot = report.locator('img[alt="layer_ratio"]')
    expect(plot).to_be_visible()
    plot.scroll_into_view_if_needed()
    wait_for(lambda: plot.evaluate("img => img.complete && img.naturalWidth > 100"), 20, "the plot to load")
    expect(page.locator("#model-card h3").first).to_contain_text("casp-30")
    screenshot(page, "job.png", height=1250)

    # The checkpoint through its link: the bytes the row's sha256 names, which are the API's.
    row = page.locator('#artifacts tr[data-artifact="model.safetensors"]')
    with page.expect_download() as download:
        row.get_by_role("link", name="model.safetensors").click()
    saved = tmp_path / "model.safetensors"
    download.value.save_as(saved)
    digest = hashlib.sha256(saved.read_bytes()).hexdigest()
    artifacts = {a["name"]: a for a in api_get(server, keys["alice"], f"/v1/jobs/{job_id}/artifacts")["data"]}
    assert digest == artifacts["model.safetensors"]["sha256"]
    expect(row.locator(".sha256")).to_have_text(digest)

    # The list: the job with its status and achieved ratio; a filter that leaves it out shows none.
    page.goto(f"{server}/console")
    job_row = page.locator(f'#jobs tr[data-job-id="{job_id}"]')
    expect(job_row).to_contain_text("succeeded")
    expect(job_row).to_contain_text("ratio 0.3")
    expect(job_row).to_contain_text(f"{job['result']['achieved_ratio']:.4f}")
    screenshot(page, "jobs.png", height=400)
    page.get_by_label("Status").select_option("failed")
    expect(page.locator("#jobs tbody tr")).to_have_count(0)
    expect(page.get_by_text("No jobs here.")).to_be_visible()
    page.get_by_label("Status").select_option("succeeded")
    expect(job_row).to_be_visible()

    # Usable at 390 px: nothing wider than the screen but the tables, which scroll in their own box.
    page.set_viewport_size({"width": 390, "height": 844})
    for path in ("/console", f"/console/jobs/{job_id}", "/console/new", "/console/usage"):
        page.goto(f"{server}{path}")
        expect(page.locator("main")).to_be_visible()
        page.wait_for_load_state("networkidle")
        assert page.evaluate("document.documentElement.scrollWidth") <= 390, path

    # Delete, once confirmed: the links go, and the API answers 410 for the artifacts from then on.
    page.goto(f"{server}/console/jobs/{job_id}")
    expect(page.locator("#artifacts tbody tr")).not_to_have_count(0)
    page.once("dialog", lambda dialog: dialog.accept())
    page.get_by_role("button", name="Delete its artifacts").click()
    expect(page.locator("#artifacts-note")).to_have_text("The artifacts were deleted.")
    expect(page.locator("#artifacts tbody tr")).to_have_count(0)
    gone = httpx.get(f"{server}/v1/jobs/{job_id}/artifacts", headers={"Authorization": f"Bearer {keys['alice']}"})
    assert gone.status_code == 410
    page.reload()
    expect(page.locator("#artifacts-note")).to_contain_text("the job's artifacts expired at")


def test_the_api_s_422_is_shown_beside_the_field_it_names(page: Page, server: str, keys: dict[str, str]) -> None:
    sign_in(page, f"{server}/console/new", keys["alice"])
    before = api_get(server, keys["alice"], "/v1/usage")["submissions_last_minute"]
    ratio = page.locator('[data-field="ratio"]')
    # Each field as the schema has it: description, range and default.
    expect(ratio.locator(".hint")).to_contain_text("fraction of decoder parameters to remove")
    expect(ratio.locator(".hint")).to_contain_text("a number > 0 and < 1")
    form_field(page, "calibration.n_samples")
    expect(page.locator('[data-field="calibration.n_samples"] .hint')).to_contain_text("default 128")
    # Every control has a label.
    unlabelled = page.evaluate(
        "[...document.querySelectorAll('input, select, textarea')].filter(c => !c.labels.length).map(c => c.id)"
    )
    assert unlabelled == []

    # By keyboard: the fields, then Enter.
    fill_field(page, "model", TINY_JOB["model"])
    form_field(page, "ratio").fill("1.5")
    form_field(page, "ratio").press("Enter")
    expect(ratio.locator(".field-error")).to_have_text("Input should be less than 1")
    expect(form_field(page, "ratio")).to_have_attribute("aria-invalid", "true")
    expect(form_field(page, "ratio")).to_be_focused()
    expect(page.locator('[data-field="model"] .field-error')).to_be_empty()
    assert api_get(server, keys["alice"], "/v1/usage")["submissions_last_minute"] == before  # no job made


def new_user(settings: Settings) -> str:
    """A key of its own, with no job yet."""
    with session_scope(settings.database) as session:
        return api_keys.create_api_key(session, "newcomer")[1]


@pytest.mark.slow
def test_a_new_user_submits_a_gguf_budget_from_a_preset_without_opening_advanced(
    page: Page, server: str, settings: Settings
) -> None:
    """Issue #40's "Done when": two presets, the model and a size, Submit; the job page shows the front and the
    pick. Advanced stays folded throughout."""
    key = new_user(settings)
    sign_in(page, f"{server}/console/new", key)
    page.get_by_role("button", name="Quick check").click()
    page.get_by_role("button", name="For llama.cpp within a size").click()
    expect(page.get_by_label("to a budget", exact=False)).to_be_checked()
    max_bytes = page.locator('[data-field="target.max_bytes"]').get_by_label("max_bytes")
    expect(max_bytes).to_be_focused()
    expect(page.locator('[data-field="ratio"]')).to_be_hidden()
    max_bytes.fill("400KB")
    model = page.get_by_label("model (required)")
    model.fill(TINY_JOB["model"])
    model.press("Tab")
    expect(page.locator("#check-model")).to_have_text(f"A job takes it: {TINY_JOB['model']}")
    screenshot(page, "new.png")
    assert page.locator("#advanced").evaluate("details => details.open") is False
    page.get_by_role("button", name="Submit the job").click()
    page.wait_for_url(re.compile(r"/console/jobs/[0-9a-f]{32}$"))
    job_id = page.url.rsplit("/", 1)[1]

    settings_sent = api_get(server, key, f"/v1/jobs/{job_id}")["settings"]
    assert settings_sent["target"]["max_bytes"] == 400_000 and settings_sent["target"]["format"] == "gguf"
    assert settings_sent["ratio"] is None and settings_sent["ratios"] == [0.2, 0.4]
    assert settings_sent["calibration"]["n_samples"] == 16 and settings_sent["evaluation"]["limit"] == 8

    expect(page.locator("#status")).to_have_text("succeeded", timeout=JOB_SECONDS)
    frontier = api_get(server, key, f"/v1/jobs/{job_id}")["result"]["frontier"]
    pick = frontier["pick"]
    pick_name = f"{'dense' if pick['dense'] else 'ratio ' + str(pick['ratio'])}, {pick['variant']}"
    # The file of lowest perplexity within the size: no point is both smaller and lower, so it is on the front.
    assert pick in frontier["front"], frontier
    front = page.locator("#front")
    expect(front).to_be_visible()
    expect(front.locator("polygon.pick")).to_have_count(1)
    expect(front.locator("polygon.pick title")).to_have_text(f"pick: {pick_name}")
    expect(front.locator("tbody tr.pick")).to_have_count(1)
    expect(front.locator("tbody tr.pick th")).to_have_text(f"{pick_name} (pick)")
    expect(front.locator("tbody tr")).to_have_count(len(frontier["front"]))
    front.scroll_into_view_if_needed()
    front.screenshot(path=str(SCREENSHOTS / "front.png"))


def test_a_model_is_checked_when_it_loses_focus(page: Page, server: str, keys: dict[str, str]) -> None:
    """The model field offers the key's choices, and says beside it what POST /v1/jobs would: the API's 422, or
    the model as a job stores it. A check makes no job."""
    sign_in(page, f"{server}/console/new", keys["bob"])
    before = api_get(server, keys["bob"], "/v1/usage")["submissions_last_minute"]
    expect(page.locator(f'#model-choices option[value="{TINY_JOB["model"]}"]')).to_have_count(1)
    model = page.get_by_label("model (required)")
    error = page.locator('[data-field="model"] .field-error')
    for bad in ("/etc", "stories260K", f"{TINY_JOB['model']}/config.json.gguf"):
        answer = httpx.post(
            f"{server}/v1/models/check", json={"model": bad}, headers={"Authorization": f"Bearer {keys['bob']}"}
        )
        assert answer.status_code == 422 and answer.json()["error"]["param"] == "model", answer.text
        model.fill(bad)
        model.blur()
        expect(error).to_have_text(answer.json()["error"]["message"].removeprefix("model: "))
        expect(model).to_have_attribute("aria-invalid", "true")
        expect(page.locator("#check-model")).to_be_empty()
    model.fill(TINY_JOB["model"])
    model.blur()
    expect(page.locator("#check-model")).to_have_text(f"A job takes it: {TINY_JOB['model']}")
    expect(error).to_be_empty()
    expect(model).not_to_have_attribute("aria-invalid", "true")
    assert api_get(server, keys["bob"], "/v1/usage")["submissions_last_minute"] == before


# What each preset fills, as the fields show it (a select's empty value: its default).
PRESET_VALUES = {
    "Quick check": {"calibration.dataset": "wikitext2:validation", "calibration.n_samples": "16",
                    "calibration.seq_len": "256", "evaluation.perplexity": "wikitext2", "evaluation.limit": "8",
                    "ratios": "0.2, 0.4"},
    "The paper's settings": {"alpha": "1", "solver": "greedy", "allocation": "gradient", "compensation": "none",
                             "calibration.dataset": "wikitext2", "calibration.n_samples": "128",
                             "calibration.seq_len": "2048", "calibration.seed": "0",
                             "evaluation.perplexity": "wikitext2, ptb",
                             "evaluation.limit": "",
                             "evaluation.zero_shot": "boolq, piqa, hellaswag, winogrande, arc_easy, arc_challenge, "
                                                     "openbookqa"},
    "For llama.cpp within a size": {"target.format": "gguf", "target.max_params": "", "gguf_types": ""},
}  # fmt: skip


def test_the_presets_fill_their_fields_and_the_form_sends_the_aim_chosen(
    page: Page, server: str, keys: dict[str, str]
) -> None:
    sign_in(page, f"{server}/console/new", keys["bob"])
    form_field(page, "model").fill(TINY_JOB["model"])
    form_field(page, "ratio").fill("0.3")
    form_field(page, "calibration.batch_size").fill("4")
    for preset, values in PRESET_VALUES.items():
        page.get_by_role("button", name=preset).click()
        for path, value in values.items():
            expect(page.locator(f'[data-field="{path}"]').locator("input, select, textarea")).to_have_value(value)
        expect(page.locator("#preset-note")).to_contain_text(f"{preset}: ")
    # A field no preset names is kept; the budget's preset hid the ratio.
    expect(form_field(page, "calibration.batch_size")).to_have_value("4")
    expect(form_field(page, "ratio")).to_be_hidden()

    # The budget chosen, the ratio typed before is not sent; a budget without a size is the API's to refuse.
    sent: list[Any] = []
    page.on("request", lambda r: sent.append(r.post_data_json) if r.method == "POST" and "/v1/jobs" in r.url else None)
    page.get_by_role("button", name="Submit the job").click()
    expect(page.locator('[data-field="target.format"] .field-error')).to_have_text("only goes with max_bytes")
    assert "ratio" not in sent[0] and sent[0]["target"] == {"format": "gguf"}, sent
    assert sent[0]["calibration"]["n_samples"] == 128 and sent[0]["ratios"] == [0.2, 0.4]
    # A budget of nothing at all: the API's reason, naming `target`, which is no field, above the button.
    form_field(page, "target.format").select_option("")
    page.get_by_role("button", name="Submit the job").click()
    expect(page.locator("#form-error")).to_have_text(
        "invalid_request: target: give exactly one of max_bytes, max_params, max_perplexity_increase, got none"
    )
    assert sent[1]["target"] == {}, sent
    # Back to a ratio: the budget's fields are not sent (a ratio out of range: no job is made).
    page.get_by_label("by a ratio").check()
    expect(form_field(page, "ratio")).to_have_value("0.3")
    form_field(page, "ratio").fill("1.5")
    page.get_by_role("button", name="Submit the job").click()
    expect(page.locator('[data-field="ratio"] .field-error')).to_have_text("Input should be less than 1")
    assert sent[2]["ratio"] == 1.5 and not {"target", "ratios", "gguf_types"} & set(sent[2]), sent[2]
    assert sent[2]["calibration"]["batch_size"] == 4


def test_a_field_the_console_does_not_name_still_shows_under_advanced(
    page: Page, server: str, keys: dict[str, str]
) -> None:
    """The form comes from the OpenAPI document: a setting added to POST /v1/jobs lands in Advanced's "Other"
    group with its description, while the stages keep their order."""

    def with_a_new_setting(route: Route) -> None:
        document = route.fetch().json()
        document["components"]["schemas"]["JobCreate"]["properties"]["colour"] = {
            "type": "string",
            "description": "the job's colour",
        }
        route.fulfill(json=document)

    page.route("**/openapi.json", with_a_new_setting)
    sign_in(page, f"{server}/console/new", keys["bob"])
    order = ["calibration", "solver", "compensation", "evaluation", "recovery", "experts", "device", "job", "other"]
    groups = page.locator("#advanced fieldset.stage")
    # The form is built once the OpenAPI document has come: its groups are read when they are all there.
    expect(groups).to_have_count(len(order))
    assert groups.evaluate_all("sets => sets.map(s => s.dataset.stage)") == order
    other = page.locator('fieldset[data-stage="other"]')
    expect(other.locator("[data-field]")).to_have_count(1)
    expect(other.locator('[data-field="colour"] .hint')).to_contain_text("the job's colour")
    expect(page.locator("#advanced")).not_to_have_attribute("open", "")


@pytest.fixture(scope="module")
def alice_job(server: str, keys: dict[str, str]) -> str:
    """A job of alice's, cancelled at once: what bob must not see."""
    job = api_post(server, keys["alice"], "/v1/jobs", TINY_JOB)
    api_post(server, keys["alice"], f"/v1/jobs/{job['id']}/cancel")
    return job["id"]


def test_another_key_s_job_is_refused(page: Page, server: str, keys: dict[str, str], alice_job: str) -> None:
    sign_in(page, f"{server}/console/jobs/{alice_job}", keys["bob"])
    expect(page.locator("#page-error")).to_have_text(f"not_found: no job {alice_job}")
    expect(page.locator("#job")).to_be_hidden()
    expect(page.locator("#events tbody tr")).to_have_count(0)
    page.goto(f"{server}/console")
    expect(page.get_by_text("No jobs here.")).to_be_visible()
    expect(page.locator("#jobs tbody tr")).to_have_count(0)
    page.goto(f"{server}/console/usage")
    usage = page.locator("#usage")
    expect(usage).to_contain_text("bob")
    expect(usage.locator("dt", has_text="Jobs queued or running").locator("+ dd")).to_have_text("0 of 8")
    expect(usage.locator("dt", has_text="Jobs submitted in the last minute").locator("+ dd")).to_have_text("0 of 30")

    # A wrong key is refused, and the form asks again.
    page.get_by_role("button", name="Forget the key").click()
    page.get_by_label("API key").fill("casp_not-a-key")
    page.get_by_role("button", name="Use this key").click()
    expect(page.locator("#key-error")).to_contain_text("a valid API key is required")
    expect(page.locator("main")).to_be_hidden()


@pytest.mark.slow
def test_cancel_a_running_job(
    page: Page, context: BrowserContext, server: str, keys: dict[str, str], alice_job: str
) -> None:
    job = api_post(server, keys["alice"], "/v1/jobs", RUNS_UNTIL_CANCELLED)
    sign_in(page, f"{server}/console/jobs/{job['id']}", keys["alice"])
    expect(page.locator("#status")).to_have_text("running", timeout=JOB_SECONDS)
    expect(page.locator('#stages li[data-state="running"]')).to_have_count(1, timeout=JOB_SECONDS)
    # The list in another tab (a key of its own: sessionStorage is the tab's) reads itself again while it runs.
    listing = context.new_page()
    sign_in(listing, f"{server}/console", keys["alice"])
    expect(listing.locator(f'#jobs tr[data-job-id="{job["id"]}"]')).to_contain_text("running")
    # Its duration counts on by itself: the page reads the job again only on status events.
    counted = page.locator("#duration").inner_text()
    expect(page.locator("#duration")).not_to_have_text(counted, timeout=5_000)
    # The worker may stop within a quarter second of the cancel, hiding the button before an `expect` looks: the
    # page records every state the button is shown in instead.
    page.evaluate(BUTTON_STATES_RECORDER, "#cancel")
    page.get_by_role("button", name="Cancel the job").click()
    expect(page.locator("#status")).to_have_text("cancelled", timeout=JOB_SECONDS)
    shown = page.evaluate("window.buttonStates")
    assert {"text": "Cancel requested", "disabled": True, "hidden": False} in shown, shown
    assert shown[-1]["hidden"], shown
    expect(page.locator('#stages li[data-state="cancelled"]')).to_have_count(1)
    expect(page.locator("#events tbody tr").last).to_contain_text("cancelled")
    expect(page.locator("#results")).to_be_hidden()
    assert finished(api_get(server, keys["alice"], f"/v1/jobs/{job['id']}"))
    expect(listing.locator(f'#jobs tr[data-job-id="{job["id"]}"]')).to_contain_text("cancelled", timeout=10_000)
    listing.close()

    # The list a page at a time, newest first: all but the oldest of alice's jobs (at least alice_job and this
    # one), then the oldest alone; filtered, her cancelled ones.
    listed = api_get(server, keys["alice"], "/v1/jobs")["data"]
    newest_first = [listed_job["id"] for listed_job in listed]
    assert len(newest_first) >= 2 and newest_first[0] == job["id"] and alice_job in newest_first
    first_page = len(newest_first) - 1
    page.goto(f"{server}/console?limit={first_page}")
    rows = page.locator("#jobs tbody tr")
    expect(rows).to_have_count(first_page)
    assert rows.evaluate_all("rows => rows.map(r => r.dataset.jobId)") == newest_first[:-1]
    expect(page.get_by_role("button", name="Previous page")).to_be_disabled()
    page.get_by_role("button", name="Next page").click()
    expect(rows).to_have_count(1)
    expect(rows.first).to_have_attribute("data-job-id", newest_first[-1])
    expect(page.get_by_role("button", name="Next page")).to_be_disabled()
    page.get_by_role("button", name="Previous page").click()
    expect(rows.first).to_have_attribute("data-job-id", newest_first[0])
    expect(rows).to_have_count(first_page)
    # The filter from the address, as the select puts it there.
    page.goto(f"{server}/console?status=cancelled")
    expect(page.get_by_label("Status")).to_have_value("cancelled")
    expect(rows).to_have_count(sum(listed_job["status"] == "cancelled" for listed_job in listed))


def test_a_failed_job_shows_its_error(page: Page, server: str, keys: dict[str, str]) -> None:
    # Offline (HF_HUB_OFFLINE=1) and not cached: the worker cannot find it, at once.
    job = api_post(server, keys["alice"], "/v1/jobs", {**TINY_JOB, "model": "casp-tests/no-such-model"})
    sign_in(page, f"{server}/console/jobs/{job['id']}", keys["alice"])
    expect(page.locator("#status")).to_have_text("failed", timeout=JOB_SECONDS)
    expect(page.locator("#job-error")).to_contain_text("model_not_found: ")
    expect(page.locator("#results")).to_be_hidden()
    expect(page.get_by_role("button", name="Delete its artifacts")).to_be_visible()


def test_without_auth_no_key_is_asked(browser: Browser, tmp_path: Path) -> None:
    settings = embedded_settings(tmp_path, auth="none", embedded_workers=0)
    with serving(service_app(settings)) as url:
        page = browser.new_page()
        page.goto(f"{url}/console")
        expect(page.locator("main")).to_be_visible()
        expect(page.locator("#key-form")).to_have_count(0)
        expect(page.get_by_text("No jobs here.")).to_be_visible()
        page.close()


@pytest.mark.slow
def test_a_page_refused_a_stream_polls_instead(browser: Browser, tmp_path: Path) -> None:
    """With one stream a key (here: the one caller of a server without keys), a second page of a running job is
    answered 429 and follows the job by polling its events."""
    settings = embedded_settings(tmp_path, auth="none", embedded_workers=1, max_streams_per_key=1)
    with serving(service_app(settings)) as url:
        job = httpx.post(f"{url}/v1/jobs", json=RUNS_UNTIL_CANCELLED, timeout=30).json()
        streaming, polling = browser.new_page(), browser.new_page()
        streaming.goto(f"{url}/console/jobs/{job['id']}")
        expect(streaming.locator('#stages li[data-state="running"]')).to_have_count(1, timeout=JOB_SECONDS)
        refused: list[int] = []
        polling.on("response", lambda r: refused.append(r.status) if "stream=true" in r.url else None)
        polling.goto(f"{url}/console/jobs/{job['id']}")
        expect(polling.locator('#stages li[data-state="running"]')).to_have_count(1)
        assert refused == [429]
        httpx.post(f"{url}/v1/jobs/{job['id']}/cancel", timeout=30).raise_for_status()
        for page in (streaming, polling):
            expect(page.locator("#status")).to_have_text("cancelled", timeout=JOB_SECONDS)
            expect(page.locator("#events tbody tr").last).to_contain_text("cancelled")
            page.close()


def test_the_pages_are_the_server_s_own(server: str) -> None:
    """Every asset a page names is served here, and the policy lets the page reach nothing else."""
    for path in ("/console", "/console/new", "/console/usage", f"/console/jobs/{'0' * 32}"):
        response = httpx.get(f"{server}{path}")
        assert response.status_code == 200, path
        csp = response.headers["content-security-policy"]
        assert "default-src 'none'" in csp and "connect-src 'self';" in csp and "img-src 'self';" in csp
        links = re.findall(r'(?:src|href)="([^"]+)"', response.text)
        assert all(link.startswith(("/", "#")) for link in links), links
        for link in links:
            if link.startswith("/"):
                assert httpx.get(f"{server}{link}").status_code == 200, link


def test_a_budget_job_s_frontier_renders_with_its_plot(page: Page, server: str) -> None:
    """report.md's frontier section, as casp_core writes it, through the console's Markdown: the candidates'
    table and the plot from its signed link; an image elsewhere, or HTML in the text, is shown as text."""
    points = [
        {"dense": True, "ratio": 0.0, "variant": "f16", "bytes": 1_000_000, "params": 260_000},
        {"dense": False, "ratio": 0.2, "variant": "f16", "bytes": 800_000, "params": 210_000},
        {"dense": False, "ratio": 0.3, "variant": "q8_0", "bytes": 400_000, "params": 180_000},
    ]
    for point, perplexity in zip(points, (10.0, 11.0, 12.5), strict=True):
        point |= {"perplexity": {"wikitext2": perplexity}, "within_target": True, "on_front": True, "seconds": 1.0}
    frontier = {
        "target": {"max_bytes": 900_000, "format": "gguf"},
        "format": "gguf",
        "perplexity_text": "wikitext2",
        "dense_perplexity": {"wikitext2": 10.0},
        "candidates": points,
        "pick": points[1],
    }
    markdown = "\n".join(
        [*render_frontier_section(frontier), "![elsewhere](https://example.com/x.png) <img src=x onerror=alert(1)>"]
    )
    page.goto(f"{server}/console")
    rendered = page.evaluate(
        """async (text) => {
            const { renderMarkdown } = await import("/console/static/markdown.js");
            const links = { "frontier.png": "/console/static/favicon.svg" };
            const article = document.createElement("article");
            article.append(...renderMarkdown(text, (target) => links[target] ?? null));
            return {
                rows: [...article.querySelectorAll("tbody tr")].map((row) => row.cells[0].textContent),
                images: [...article.querySelectorAll("img")].map((img) => img.getAttribute("src")),
                heading: article.querySelector("h4").textContent,
                text: article.textContent,
            };
        }""",
        markdown,
    )
    assert rendered["heading"] == "Sweep: the candidates and the pick"
    assert rendered["rows"] == ["dense", "0.2 (pick)", "0.3"]
    assert rendered["images"] == ["/console/static/favicon.svg"]
    assert "elsewhere <img src=x onerror=alert(1)>" in rendered["text"]


SUMMARY_OF = """async (result) => {
    const { summaryRows } = await import("/console/static/summary.js");
    return summaryRows(result).map((row) => [...row.cells].map((cell) => cell.textContent));
}"""


def test_a_recovered_job_s_summary_sets_the_published_model_beside_dense_and_pruned(page: Page, server: str) -> None:
    """After recovery the published checkpoint is the recovered model: its column comes after the pruned one's,
    and the last column compares it, not the pruned model, with dense."""
    accuracies = {"dense": 0.5, "pruned": 0.4, "recovered": 0.45}
    report = {
        "achieved_ratio": 0.3,
        "params": {"dense": 1000, "pruned": 700, "counted": "all parameters"},
        "perplexity": {"wikitext2": {"dense": 10.0, "pruned": 14.0, "recovered": 12.0, "seq_len": 128}},
        "evaluation": {
            "zero_shot": {
                model: {"tasks": {"arc_easy": {"acc": accuracy, "n_samples": 1200}}}
                for model, accuracy in accuracies.items()
            }
        },
        "recovery": {key: None for key in RECOVERY_SUMMARY} | {"curve": [{"loss": 2.5}]},
    }
    page.goto(f"{server}/console")
    rows = page.evaluate(SUMMARY_OF, summary_of(report))
    assert rows == [
        ["", "dense", "pruned", "recovered", "recovered / dense"],
        ["parameters (all parameters)", "1,000", "700", "700", "0.700"],
        ["perplexity wikitext2 (128-token windows)", "10.000", "14.000", "12.000", "1.200"],
        ["accuracy arc_easy (1,200 documents)", "0.500", "0.400", "0.450", "0.900"],
    ]
    del report["recovery"]  # without recovery: dense against pruned, as the form's job shows
    assert page.evaluate(SUMMARY_OF, summary_of(report))[0] == ["", "dense", "pruned", "pruned / dense"]


def budget_result(max_bytes: int, candidates: str) -> dict[str, Any]:
    """A budget job's result as the worker writes it (`summary_of`), from the sweep's own front and pick over
    points of known sizes: the dense f16 and q8_0, and ratios 0.2 and 0.4 in f16 and q8_0."""
    goal = Target(PruneConfig(target={"max_bytes": max_bytes, "candidates": candidates}), 10.0)
    sizes = [(0.0, "f16", 1000, 10.0), (0.0, "q8_0", 530, 10.1), (0.2, "f16", 800, 11.0), (0.2, "q8_0", 420, 11.2),
             (0.4, "q8_0", 330, 13.0), (0.4, "f16", 600, 12.0)]  # fmt: skip
    points = [
        replace(point, within_target=goal.met_by(point.bytes, point.params, first_perplexity(point)))
        for point in on_front(
            [Point(r, "gguf", v, size, 1000, {"wikitext2": p}, 1.0, r == 0.0, False) for r, v, size, p in sizes]
        )
    ]
    pick = goal.pick(points)
    frontier = {
        "target": goal.config.target.to_dict(),
        "candidates": [p.to_dict() for p in points],
        "pick": pick.to_dict(),
    }
    if pick.dense:
        best_pruned = goal.best(points, dense=False)
        frontier |= {"dense_pick": goal.dense_pick_reason(pick, best_pruned), "best_pruned": best_pruned.to_dict()}
    return summary_of({"achieved_ratio": 0.0, "frontier": frontier})


FRONT_OF = """async (frontier) => {
    const { renderFront } = await import("/console/static/frontier.js");
    const section = document.createElement("section");
    section.append(...renderFront(frontier));
    document.body.append(section);
    const star = section.querySelector("polygon.pick");
    const xs = star.getAttribute("points").split(" ").map((corner) => Number(corner.split(",")[0]));
    return {
        reason: section.querySelector("#dense-pick")?.textContent ?? null,
        rows: [...section.querySelectorAll("tbody tr")].map((row) => row.cells[0].textContent),
        marked: [...section.querySelectorAll("tbody tr.pick")].map((row) => row.cells[0].textContent),
        circles: Object.fromEntries([...section.querySelectorAll("circle")].map(
            (circle) => [circle.querySelector("title").textContent, Number(circle.getAttribute("cx"))])),
        star: { x: (Math.min(...xs) + Math.max(...xs)) / 2, title: star.querySelector("title").textContent },
        stars: section.querySelectorAll("polygon.pick").length,
        front: section.querySelector("polyline.front").getAttribute("points").split(" ").length,
        budget: Number(section.querySelector("line.budget").getAttribute("x1")),
    };
}"""


def test_a_budget_job_s_front_is_drawn_with_its_pick_marked(page: Page, server: str) -> None:
    """The job page's front (frontier.js) from a result as the worker writes it: the front's points joined, the
    pick a star at its size, the budget a dashed line, a table with the pick's row marked; a dense pick with the
    sentence that says why. A pick off the front (target.candidates "pruned", a dense point better) is drawn too."""
    page.goto(f"{server}/console")
    result = budget_result(700, "all")
    shown = page.evaluate(FRONT_OF, result["frontier"])
    assert shown["reason"] == f"Why the dense model: {result['frontier']['dense_pick']}."
    assert "the best pruned candidate within it is ratio 0.2, q8_0" in shown["reason"]
    # Smallest first: every point is on the front here, the dense q8_0 the pick (the lowest perplexity in 700).
    assert shown["rows"] == ["ratio 0.4, q8_0", "ratio 0.2, q8_0", "dense, q8_0 (pick)", "dense, f16"]
    assert shown["marked"] == ["dense, q8_0 (pick)"] and shown["front"] == 4
    assert shown["stars"] == 1 and shown["star"]["title"] == "pick: dense, q8_0"
    # The star sits at 530 bytes: between 420 and the budget's 700, on the same scale as the circles.
    circles = shown["circles"]
    scale = (circles["dense, f16"] - circles["ratio 0.4, q8_0"]) / (1000 - 330)
    assert shown["star"]["x"] == pytest.approx(circles["ratio 0.4, q8_0"] + (530 - 330) * scale, abs=0.5)
    assert shown["budget"] == pytest.approx(circles["ratio 0.4, q8_0"] + (700 - 330) * scale, abs=0.5)

    result = budget_result(900, "pruned")
    shown = page.evaluate(FRONT_OF, result["frontier"])
    assert shown["reason"] is None
    # 0.2 f16 (800 bytes, 11.0) is the best pruned point; the dense q8_0 beats it, so it is drawn off the front.
    assert shown["marked"] == ["ratio 0.2, f16 (pick)"] and "ratio 0.2, f16 (pick)" in shown["rows"]
    assert shown["front"] == 4 and len(shown["rows"]) == 5
