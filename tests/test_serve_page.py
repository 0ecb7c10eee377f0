"""The server's page as a person uses it: headless Debian chromium (through its chromedriver, with
Selenium; nothing downloads a browser or a driver), a synthesized Konkani recording as the fake
microphone, Start, then Stop: the finals on the page are the offline stream of the same file under
the same settings (within a CER bound: the microphone's start moves by a few ms); a file chosen in
the drop zone is transcribed on the page as POST /transcribe answers. With
KONKANIVANI_SCREENSHOT=path the page is saved there (docs/serve_page.png). A page served from
another local port, in the same browser after it has the token's cookie, gets nothing
from the server: its WebSocket no ready, its POST 403."""
import json
import os
import re
import shutil
import threading
import time
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import soundfile as sf
import torch
from serve_helpers import http, served, train_model, wait_until

from konkanivani.checkpoint import save_checkpoint
from konkanivani.data.audio import load_audio
from konkanivani.data.manifest import read_manifest
from konkanivani.decoding.metrics import error_rates
from konkanivani.decoding.recognizer import Recognizer

pytestmark = pytest.mark.slow
CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")
TOKEN = "page-token"
CHUNK = 8  # the model below is trained for chunks of 1-8 frames
CLIPS, STEPS = 2, 400  # learned well enough that the page's resampled audio reads the same
EVIL_HOST = "evil.example"  # a foreign name the browser resolves to 127.0.0.1


@pytest.fixture(scope="module")
def konkani(tiny_corpus, tmp_path_factory):
    """A tiny streaming model that has learned CLIPS clips of the corpus with silence around them
    (it need not generalize: the page must show what the model says), and the first of them as the
    16-bit
    wav the fake microphone plays."""
    import dataclasses

    rows = [row for _, row in read_manifest(tiny_corpus / "train.jsonl")][:CLIPS]
    silence = torch.zeros(16000)
    wavs = [
        torch.cat([silence, load_audio(tiny_corpus / row["audio_filepath"]), silence, silence])
        for row in rows
    ]
    # and 3 s of silence read as nothing: the microphone goes on after the file, and a segment that
    # starts in silence after an endpoint must not make up words the offline decoding never heard
    rec = train_model(
        [*wavs, torch.zeros(48000)],
        [row["text"] for row in rows] + [""],
        streaming=True,
        steps=STEPS,
        vocab_size=80,
    )
    out = tmp_path_factory.mktemp("serve_page")
    checkpoint = save_checkpoint(
        {
            "model_config": dataclasses.asdict(rec.model.cfg),
            "model": rec.model.state_dict(),
            "tokenizer": rec.tokenizer.model_proto,
        },
        out / "konkani.pt",
    )
    sf.write(out / "speech.wav", wavs[0].numpy(), 16000, subtype="PCM_16")
    return checkpoint, out / "speech.wav"


@contextmanager
def _chromium(*args: str):
    """Headless chromium through its chromedriver, with ``args``; ``EVIL_HOST`` resolves to
    127.0.0.1 in it (a host-resolver rule: what DNS rebinding makes of a name)."""
    if not (CHROMIUM.exists() and CHROMEDRIVER.exists()):
        pytest.skip(
            f"needs Debian's chromium and chromium-driver ({CHROMIUM}, {CHROMEDRIVER}): "
            "apt-get install chromium chromium-driver (training_scripts/setup_env.sh --dev does)"
        )
    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=900,820", f"--host-resolver-rules=MAP {EVIL_HOST} 127.0.0.1",
                *args):
        options.add_argument(arg)
    # the browser's own record of its requests: the status of one its page may not read (CORS)
    options.set_capability("goog:loggingPrefs", {"performance": "ALL"})
    with pytest.MonkeyPatch.context() as env:
        env.setenv("SE_OFFLINE", "true")  # Selenium Manager may not fetch anything
        driver = webdriver.Chrome(service=Service(executable_path=str(CHROMEDRIVER)),
                                  options=options)
    driver.set_page_load_timeout(60)
    driver.set_script_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture
def browser(konkani):
    with _chromium("--use-fake-ui-for-media-stream", "--use-fake-device-for-media-stream",
                   f"--use-file-for-fake-audio-capture={konkani[1]}%noloop",
                   "--autoplay-policy=no-user-gesture-required") as driver:
        yield driver


def _state(driver) -> str:
    return driver.execute_script("return document.body.dataset.state || ''")


def _texts(driver, list_id: str) -> list[str]:
    return driver.execute_script(
        f"return [...document.querySelectorAll('#{list_id} li .text')].map(e => e.textContent)")


def test_the_page_shows_what_the_recognizer_says(konkani, browser):
    from selenium.webdriver.common.by import By

    checkpoint, speech = konkani
    rec = Recognizer.from_checkpoint(checkpoint)
    wav = load_audio(speech)
    offline = [
        r.text
        for r in rec.stream_results(wav.split(1600), chunk_size=CHUNK)
        if r.is_final and r.text
    ]
    assert offline and any(offline)
    seconds = len(wav) / 16000
    with served(checkpoint, "--token", TOKEN, "--chunk_size", str(CHUNK)) as server:
        browser.get(server.url + f"?token={TOKEN}")
        assert wait_until(lambda: browser.find_element(By.ID, "start").is_enabled(), 60), _state(
            browser
        )
        browser.find_element(By.ID, "start").click()
        assert wait_until(lambda: _state(browser) in ("listening", "error"), 60)
        assert _state(browser) == "listening", browser.find_element(By.ID, "status").text
        started = time.monotonic()
        # The fake microphone plays the file in real time, then silence: wait for its finals.
        assert wait_until(
            lambda: len(_texts(browser, "finals")) >= len(offline)
            and time.monotonic() - started > seconds,
            seconds + 60,
            every=0.5,
        ), (
            _texts(browser, "finals"),
            browser.find_element(By.ID, "status").text,
            "".join(server.log)[-2000:],
        )
        browser.find_element(By.ID, "stop").click()
        assert wait_until(lambda: _state(browser) in ("done", "error"), 60)
        assert _state(browser) == "done", browser.find_element(By.ID, "status").text
        # The page went on sending the microphone's silence after the file until Stop: the offline
        # stream hears as much (the server's count of the audio it took).
        taken = float(browser.execute_script("return document.body.dataset.audioSeconds"))
        assert taken > seconds
        padded = torch.cat([wav, torch.zeros(round((taken - seconds) * 16000))])
        offline = [
            r.text
            for r in rec.stream_results(padded.split(1600), chunk_size=CHUNK)
            if r.is_final and r.text
        ]
        page, want = " ".join(_texts(browser, "finals")), " ".join(offline)
        # Chromium's fake microphone starts the file a few ms late at random, and the page resamples
        # what it captures itself: this tiny model's text moves with such a shift (15 ms made a
        # third of the characters differ), so the page is held to the offline text within a CER
        # bound; the upload below (the file's own samples) must match exactly.
        assert page and error_rates([want], [page])["cer"] <= 0.5, (page, want)

        browser.find_element(By.ID, "file").send_keys(str(speech))  # the drop zone's file input
        assert wait_until(lambda: _texts(browser, "upload-segments"), 60), browser.find_element(
            By.ID, "upload-status").text
        assert " ".join(_texts(browser, "upload-segments")) == " ".join(
            r.text
            for r in rec.transcribe_long(speech, method="rescore", chunk_size=CHUNK)
            if r.text
        )
        target = os.environ.get("KONKANIVANI_SCREENSHOT")
        if target:
            browser.save_screenshot(target)
        else:
            assert browser.get_screenshot_as_png()[:4] == b"\x89PNG"
        assert "".join(server.log).count("Traceback") == 0
    assert shutil.which(str(CHROMIUM))


# A page of another origin (another port of this host: the same site, so the SameSite=Strict cookie
# goes with its requests) that opens the server's WebSocket and POSTs to it with credentials; what
# it sees is left in window.outcome.
FOREIGN_PAGE = """<!doctype html><meta charset="utf-8"><title>another origin</title><script>
window.outcome = {messages: [], closed: null, post: null};
const ws = new WebSocket(%s);
ws.onmessage = (e) => window.outcome.messages.push(JSON.parse(e.data).type);
ws.onclose = (e) => { window.outcome.closed = e.code; };
fetch(%s, {method: "POST", body: new Uint8Array(64), credentials: "include"}).then(
  (r) => { window.outcome.post = "answered " + r.status; },
  (e) => { window.outcome.post = "failed"; });
</script>"""


@contextmanager
def _foreign_page(server_url: str, ws_url: str):
    """FOREIGN_PAGE served on a free port of 127.0.0.1 (a thread); its URL."""
    page = FOREIGN_PAGE % (json.dumps(ws_url + "stream"), json.dumps(server_url + "transcribe"))
    page = page.encode()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(page)))
            self.end_headers()
            self.wfile.write(page)

        def log_message(self, *args):
            pass

    http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=http.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{http.server_address[1]}/"
    finally:
        http.shutdown()
        http.server_close()
        thread.join(30)


def _answers(driver, origin: str, url: str) -> list[tuple[int, str]]:
    """(status, Cookie header) of each request the browser sent to ``url`` from a page of
    ``origin``, from its performance log (Network events), whether or not the page could read it."""
    to_url, cookies, statuses = [], {}, {}
    for entry in driver.get_log("performance"):
        message = json.loads(entry["message"])["message"]
        method, params = message["method"], message["params"]
        if method == "Network.requestWillBeSent" and params["request"]["url"] == url:
            to_url.append(params["requestId"])
        elif method == "Network.requestWillBeSentExtraInfo":
            if params["headers"].get("Origin") == origin:
                cookies[params["requestId"]] = params["headers"].get("Cookie", "")
        elif method == "Network.responseReceivedExtraInfo":
            statuses[params["requestId"]] = params["statusCode"]
    return [(statuses.get(rid, 0), cookies[rid]) for rid in to_url if rid in cookies]


def test_a_page_of_another_port_cannot_use_the_server(konkani, browser):
    """The hijack the Origin check stops: the browser has the token's cookie from the server's own
    page, whose socket gets ready and whose POST is answered; a page from another port of the same
    host then opens the WebSocket and POSTs with credentials: no ready, and the POST (sent with the
    cookie) is answered 403, which the server counts as refused for its origin."""
    checkpoint, _ = konkani
    with served(checkpoint, "--token", TOKEN, "--chunk_size", str(CHUNK)) as server:
        browser.get(server.url + f"?token={TOKEN}")
        own = browser.execute_async_script("""const done = arguments[0], out = {types: []};
            fetch("transcribe", {method: "POST", body: new Uint8Array(64)}).then((r) => {
              out.post = r.status;
              const ws = new WebSocket(location.origin.replace(/^http/, "ws") + "/stream");
              ws.onmessage = (e) => {
                out.types.push(JSON.parse(e.data).type);
                if (out.types.length === 1) ws.send(JSON.stringify({type: "end"}));
              };
              ws.onclose = (e) => { out.closed = e.code; done(out); };
            }, (e) => done({error: String(e)}));""")
        # the own page's requests carry the cookie and pass (its 64 bytes are read: not audio)
        assert own.get("post") == 400 and own["closed"] == 1000, own
        assert own["types"][0] == "ready" and own["types"][-1] == "done", own
        browser.get_log("performance")  # what came so far: the own page's requests
        with _foreign_page(server.url, server.ws_url) as foreign:
            browser.get(foreign)
            assert wait_until(lambda: browser.execute_script(
                "return window.outcome.closed !== null && window.outcome.post !== null"), 30)
            outcome = browser.execute_script("return window.outcome")
        assert outcome["messages"] == [] and outcome["closed"] == 1006, outcome  # no ready
        assert outcome["post"] == "failed", outcome  # no CORS answer: the page reads nothing
        foreign_origin = foreign.rstrip("/")
        assert _answers(browser, foreign_origin, server.url + "transcribe") == [
            (403, f"konkanivani_token={TOKEN}")]
        metrics = http("GET", server.url + "metrics",
                       headers={"Authorization": f"Bearer {TOKEN}"})[2].decode()
        assert 'konkanivani_errors_total{endpoint="/stream",reason="origin"} 1.0' in metrics
        assert 'konkanivani_errors_total{endpoint="/transcribe",reason="origin"} 1.0' in metrics
        assert 'konkanivani_requests_total{code="200",endpoint="/transcribe"}' not in metrics
        assert 'konkanivani_requests_total{code="1000",endpoint="/stream"} 1.0' in metrics  # own
        assert "Traceback" not in "".join(server.log) and "ERROR" not in "".join(server.log)


# What a page of the server's port on another name tries, run in it: fetch each endpoint (the page,
# its files, health, metrics, both uploads, the models), open the WebSocket; the statuses it reads
# (same origin: it may read them) and the stream's first message and close code.
TRY_EVERY_ENDPOINT = """const done = arguments[0], out = {};
const form = new FormData();
form.append("file", new Blob([new Uint8Array(64)]), "a.wav");
form.append("model", "any");
const asks = [["GET", "/"], ["GET", "/static/app.js"], ["GET", "/health"], ["GET", "/metrics"],
              ["POST", "/transcribe", new Uint8Array(64)], ["GET", "/v1/models"],
              ["POST", "/v1/audio/transcriptions", form]];
Promise.all(asks.map(([method, path, body]) => fetch(path, {method, body}).then(
    (r) => { out[method + " " + path] = r.status; }, (e) => { out[method + " " + path] = "failed"; }
))).then(() => {
  const ws = new WebSocket(location.origin.replace(/^http/, "ws") + "/stream");
  ws.onmessage = (e) => {  // the first message; then the end of the stream
    if (!out.ws) ws.send(JSON.stringify({type: "end"}));
    out.ws = out.ws || JSON.parse(e.data).type;
  };
  ws.onclose = (e) => { out.closed = e.code; done(out); };
});"""


def test_a_page_on_a_rebound_name_gets_nothing_from_the_server(tone_checkpoints):
    """DNS rebinding, as a browser does it: a server started without --token (the default), and a
    page of http://evil.example:PORT, a name the browser resolves to 127.0.0.1 (a host-resolver
    rule), is the same origin as the server. Every endpoint it fetches answers 400 and its
    WebSocket gets no ready; the server's own page, on 127.0.0.1, is served meanwhile."""
    with served(tone_checkpoints["streaming"], "--chunk_size",
                str(CHUNK)) as server, _chromium() as browser:
        port = server.url.rstrip("/").rsplit(":", 1)[1]
        browser.get(f"http://{EVIL_HOST}:{port}/")
        assert browser.execute_script("return document.body.innerText") == "Invalid host header"
        outcome = browser.execute_async_script(TRY_EVERY_ENDPOINT)
        refused = {k: 400 for k in outcome if k not in ("ws", "closed")}
        assert len(refused) == 7 and outcome == {**refused, "closed": 1006}, outcome
        # none of them reached an endpoint: the one request counted is this one for /metrics
        metrics = http("GET", server.url + "metrics")[2].decode()
        counted = re.findall(r"^konkanivani_requests_total({.*}) ", metrics, re.MULTILINE)
        assert counted == ['{code="200",endpoint="/metrics"}'], counted
        browser.get(server.url)
        own = browser.execute_async_script(TRY_EVERY_ENDPOINT)
        assert own["GET /"] == own["GET /health"] == own["GET /v1/models"] == 200, own
        assert own["POST /transcribe"] == own["POST /v1/audio/transcriptions"] == 400  # not audio
        assert own["ws"] == "ready" and own["closed"] == 1000, own
        assert "Traceback" not in "".join(server.log) and "ERROR" not in "".join(server.log)
