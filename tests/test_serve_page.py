"""The server's page as a person uses it: headless Debian chromium (through its chromedriver, with
Selenium; nothing downloads a browser or a driver), a synthesized Konkani recording as the fake
microphone, Start, then Stop: the finals on the page are the offline stream of the same file under
the same settings (within a CER bound: the microphone's start moves by a few ms); a file chosen in the drop zone is transcribed on the page as POST /transcribe
answers. With KONKANIVANI_SCREENSHOT=path the page is saved there (docs/serve_page.png)."""
import os
import shutil
import time
from pathlib import Path

import pytest
import soundfile as sf
import torch
from serve_helpers import served, train_model, wait_until

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


@pytest.fixture(scope="module")
def konkani(tiny_corpus, tmp_path_factory):
    """A tiny streaming model that has learned CLIPS clips of the corpus with silence around them (it
    need not generalize: the page must show what the model says), and the first of them as the 16-bit
    wav the fake microphone plays."""
    import dataclasses

    rows = [row for _, row in read_manifest(tiny_corpus / "train.jsonl")][:CLIPS]
    silence = torch.zeros(16000)
    wavs = [torch.cat([silence, load_audio(tiny_corpus / row["audio_filepath"]), silence, silence]) for row in rows]
    # and 3 s of silence read as nothing: the microphone goes on after the file, and a segment that
    # starts in silence after an endpoint must not make up words the offline decoding never heard
    rec = train_model([*wavs, torch.zeros(48000)], [row["text"] for row in rows] + [""], streaming=True,
                      steps=STEPS, vocab_size=80)
    out = tmp_path_factory.mktemp("serve_page")
    checkpoint = save_checkpoint({"model_config": dataclasses.asdict(rec.model.cfg), "model": rec.model.state_dict(),
                                  "tokenizer": rec.tokenizer.model_proto}, out / "konkani.pt")
    sf.write(out / "speech.wav", wavs[0].numpy(), 16000, subtype="PCM_16")
    return checkpoint, out / "speech.wav"


@pytest.fixture
def browser(konkani, monkeypatch):
    if not (CHROMIUM.exists() and CHROMEDRIVER.exists()):
        pytest.skip(f"needs Debian's chromium and chromium-driver ({CHROMIUM}, {CHROMEDRIVER}): "
                    "apt-get install chromium chromium-driver (training_scripts/setup_env.sh --dev does)")
    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.chrome.service import Service

    monkeypatch.setenv("SE_OFFLINE", "true")  # Selenium Manager may not fetch anything
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--window-size=900,820",
                "--use-fake-ui-for-media-stream", "--use-fake-device-for-media-stream",
                f"--use-file-for-fake-audio-capture={konkani[1]}%noloop", "--autoplay-policy=no-user-gesture-required"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(executable_path=str(CHROMEDRIVER)), options=options)
    driver.set_page_load_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()


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
    offline = [r.text for r in rec.stream_results(wav.split(1600), chunk_size=CHUNK) if r.is_final and r.text]
    assert offline and any(offline)
    seconds = len(wav) / 16000
    with served(checkpoint, "--token", TOKEN, "--chunk_size", str(CHUNK)) as server:
        browser.get(server.url + f"?token={TOKEN}")
        assert wait_until(lambda: browser.find_element(By.ID, "start").is_enabled(), 60), _state(browser)
        browser.find_element(By.ID, "start").click()
        assert wait_until(lambda: _state(browser) in ("listening", "error"), 60)
        assert _state(browser) == "listening", browser.find_element(By.ID, "status").text
        started = time.monotonic()
        # The fake microphone plays the file in real time, then silence: wait for its finals.
        assert wait_until(lambda: len(_texts(browser, "finals")) >= len(offline)
                          and time.monotonic() - started > seconds, seconds + 60, every=0.5), (
            _texts(browser, "finals"), browser.find_element(By.ID, "status").text, "".join(server.log)[-2000:])
        browser.find_element(By.ID, "stop").click()
        assert wait_until(lambda: _state(browser) in ("done", "error"), 60)
        assert _state(browser) == "done", browser.find_element(By.ID, "status").text
        # The page went on sending the microphone's silence after the file until Stop: the offline
        # stream hears as much (the server's count of the audio it took).
        taken = float(browser.execute_script("return document.body.dataset.audioSeconds"))
        assert taken > seconds
        padded = torch.cat([wav, torch.zeros(round((taken - seconds) * 16000))])
        offline = [r.text for r in rec.stream_results(padded.split(1600), chunk_size=CHUNK) if r.is_final and r.text]
        page, want = " ".join(_texts(browser, "finals")), " ".join(offline)
        # Chromium's fake microphone starts the file a few ms late at random, and the page resamples
        # what it captures itself: this tiny model's text moves with such a shift (15 ms made a third
        # of the characters differ), so the page is held to the offline text within a CER bound; the
        # upload below (the file's own samples) must match exactly.
        assert page and error_rates([want], [page])["cer"] <= 0.5, (page, want)

        browser.find_element(By.ID, "file").send_keys(str(speech))  # the drop zone's file input
        assert wait_until(lambda: _texts(browser, "upload-segments"), 60), browser.find_element(
            By.ID, "upload-status").text
        assert " ".join(_texts(browser, "upload-segments")) == " ".join(
            r.text for r in rec.transcribe_long(speech, method="rescore", chunk_size=CHUNK) if r.text)
        target = os.environ.get("KONKANIVANI_SCREENSHOT")
        if target:
            browser.save_screenshot(target)
        else:
            assert browser.get_screenshot_as_png()[:4] == b"\x89PNG"
        assert "".join(server.log).count("Traceback") == 0
    assert shutil.which(str(CHROMIUM))
