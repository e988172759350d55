"""The web page at `/`: its form, endpoints and policy without a browser; in headless Chromium against a
running server: a prompt file, a click, the audio streamed and played, the WAV equal to `cosyvoice-run
--stream`, server errors shown (both shapes), a recorded prompt (Chromium's fake microphone), the voices
listed and a standard one spoken, Stop while the audio plays on, a screenshot."""

from __future__ import annotations

import base64
import hashlib
import io
import re
import shutil
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fastapi", reason="the serve extra is not installed")

import numpy as np
import soundfile as sf
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient
from test_serve import API_KEY, SHORT, cosyvoice_run, make_app, serving

from cosyvoice_runtime.bundle import RuntimeBundle
from cosyvoice_runtime.demo import DEMO_BUNDLE
from cosyvoice_serve import Engine, routes_openai, routes_upstream
from cosyvoice_serve.auth import MISSING_KEY

ENDPOINTS = {"/inference_zero_shot", "/inference_cross_lingual", "/inference_instruct2"}
OPENAI_ENDPOINTS = {"/v1/audio/speech", "/v1/audio/voices"}
CHROMIUM_FLAGS = ["--autoplay-policy=no-user-gesture-required", "--use-fake-ui-for-media-stream",
                  "--use-fake-device-for-media-stream"]
"""Play without a gesture; grant the microphone, which is Chromium's fake device (a beep)."""
SYSTEM_CHROMIUMS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def test_the_page_has_its_form_and_uses_only_this_servers_endpoints(engine: Engine, tmp_path: Path) -> None:
    app = make_app(engine, tmp_path)
    with TestClient(app) as client:
        response = client.get("/")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/html")
    html = response.text
    for name in ("voice", "prompt_wav", "mode", "prompt_text", "instruct_text", "tts_text", "api_key"):
        assert f'id="{name}" name="{name}"' in html, name
    assert re.findall(r'<option value="(\w+)"', html) == ["zero_shot", "cross_lingual", "instruct2"]
    assert 'id="record"' in html and 'download="cosyvoice.wav"' in html
    # the picker offers what the server's reader (libsndfile) takes, not every audio/* (m4a, webm)
    assert 'accept=".wav,.flac,.ogg,.oga,.opus,.mp3,.aif,.aiff"' in html
    [script] = re.findall(r"<script>(.*?)</script>", html, flags=re.DOTALL)
    [style] = re.findall(r"<style>(.*?)</style>", html, flags=re.DOTALL)
    assert all(word in script for word in ("getUserMedia", "MediaRecorder", "AudioContext", "getReader"))

    # Nothing from elsewhere: no absolute or protocol-relative URL, no file but the empty icon.
    assert re.findall(r"""(?:https?|wss?|ftp):|["'`(]//""", html) == []
    assert re.findall(r'\b(?:src|href)="([^"]*)"', html) == ["data:,"]
    # The script fetches this server's streaming endpoints by POST, its voices by GET, and nothing else.
    assert set(re.findall(r'"(/[^"]*)"', script)) == ENDPOINTS | OPENAI_ENDPOINTS
    assert re.findall(r"fetch\(([^,)]+)", script) == ["VOICES", "request.path"]
    assert 'return key ? {"X-API-Key": key} : {};' in script  # the key typed in, if any
    assert "{headers: keyHeaders()}" in script and "{...request.headers, ...keyHeaders()}" in script  # both
    routes = {(r.path, method) for module in (routes_upstream, routes_openai) for r in module.router.routes
              if isinstance(r, APIRoute) for method in r.methods}  # create_app includes them
    wanted = {(path, "POST") for path in ENDPOINTS | {"/v1/audio/speech"}} | {("/v1/audio/voices", "GET")}
    assert wanted <= routes
    # ...and the browser holds it to that.
    policy = dict(part.split(" ", 1) for part in response.headers["content-security-policy"].split("; "))
    assert policy["default-src"] == "'none'" and policy["connect-src"] == "'self' blob:"

    def digest(text: str) -> str:
        return f"'sha256-{base64.b64encode(hashlib.sha256(text.encode()).digest()).decode()}'"

    assert policy["script-src"] == digest(script) and policy["style-src"] == digest(style)


def launch_chromium(playwright: Any) -> Any:
    """Playwright's own Chromium, else a system one; skips the test, saying why, when none starts."""
    from playwright.sync_api import Error

    tried = []
    try:
        return playwright.chromium.launch(args=CHROMIUM_FLAGS)
    except Error as e:
        tried.append(f"playwright's Chromium: {str(e).splitlines()[0]}")
    for name in SYSTEM_CHROMIUMS:
        if (path := shutil.which(name)) is None:
            continue
        try:
            return playwright.chromium.launch(executable_path=path, args=CHROMIUM_FLAGS)
        except Error as e:
            tried.append(f"{path}: {str(e).splitlines()[0]}")
    tried.append(f"no {', '.join(SYSTEM_CHROMIUMS)} on PATH")
    pytest.skip("no headless Chromium to test the page in (`playwright install chromium`, or "
                f"`apt-get install chromium`): {'; '.join(tried)}")


RUN_ENDED = ", ".join(f"body[data-state={state}]" for state in ("done", "error", "stopped"))
"""The page's state once a run has ended. (Waiting by selector: the page's policy forbids eval, which
Playwright's wait_for_function uses.)"""
DOWNLOADED_WAV = """async () => {
  const bytes = new Uint8Array(await (await fetch(document.getElementById("download").href)).arrayBuffer());
  let text = "";
  for (const byte of bytes) text += String.fromCharCode(byte);
  return btoa(text);
}"""


def test_the_page_streams_plays_and_offers_the_wav_in_chromium(engine: Engine, tmp_path: Path) -> None:
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (dev extra)")
    default = RuntimeBundle.open(DEMO_BUNDLE).default_prompt()
    assert default is not None
    expected = cosyvoice_run(tmp_path, "--stream", "--text", SHORT)
    screenshot = tmp_path / "page.png"
    with serving(make_app(engine, tmp_path, api_key=API_KEY)) as client, \
            sync_api.sync_playwright() as playwright:
        browser = launch_chromium(playwright)
        try:
            page = browser.new_page()
            page.goto(str(client.base_url))
            page.set_input_files("#prompt_wav", str(default[0]))
            page.fill("#prompt_text", default[1])
            page.fill("#tts_text", SHORT)
            page.click("#speak")  # the page is served without the key; its API calls need it
            page.wait_for_selector(RUN_ENDED, state="attached", timeout=30_000)
            assert page.text_content("#error") == f"401: {MISSING_KEY}"
            assert page.locator("#voice optgroup").count() == 0  # not listed without the key
            page.fill("#api_key", API_KEY)
            page.dispatch_event("#api_key", "change")  # lists the voices with the key
            page.wait_for_selector("#voice option[value=alloy]", state="attached", timeout=10_000)
            page.click("#speak")
            page.wait_for_selector(RUN_ENDED, state="attached", timeout=60_000)
            assert page.text_content("#error") == ""
            assert page.evaluate("document.body.dataset.samples") == str(len(expected))
            assert page.evaluate("playback.state") == "running"  # Web Audio played it
            assert page.text_content("#status").startswith(f"Done: {len(expected) / 24000:.2f} s of audio")
            wav = base64.b64decode(page.evaluate(DOWNLOADED_WAV))
            page.screenshot(path=screenshot, full_page=True)

            page.fill("#tts_text", "  ")  # passes the browser's `required`, not the server
            page.click("#speak")
            page.wait_for_selector(RUN_ENDED, state="attached", timeout=30_000)
            assert page.text_content("#error") == "400: tts_text is empty"

            page.select_option("#mode", "instruct2")
            assert page.is_hidden("#prompt_text") and page.is_visible("#instruct_text")
            page.click("#record")
            page.wait_for_timeout(1500)
            page.click("#record")
            page.wait_for_selector("#prompt-status:has-text('Prompt: a recording')", timeout=10_000)
            page.fill("#instruct_text", "Speak slowly.")
            page.fill("#tts_text", SHORT)
            page.click("#speak")
            page.wait_for_selector(RUN_ENDED, state="attached", timeout=60_000)
            assert page.text_content("#error") == ""
            assert int(page.evaluate("document.body.dataset.samples")) > 0

            # A standard voice is the bundle's prompt with its transcript: cosyvoice-run's default.
            page.select_option("#mode", "zero_shot")
            page.select_option("#voice", "alloy")
            assert page.is_hidden("#prompt_wav") and page.is_hidden("#prompt_text")
            assert page.is_disabled("#mode option[value=cross_lingual]")
            page.click("#speak")
            page.wait_for_selector(RUN_ENDED, state="attached", timeout=60_000)
            assert page.text_content("#error") == ""
            assert page.evaluate("document.body.dataset.samples") == str(len(expected))
            # The stream ended before its audio played out: Stop stays for it; replaying the WAV stops it.
            assert page.is_enabled("#stop") and page.evaluate("playback.state") == "running"
            page.evaluate("document.getElementById('player').play()")
            page.wait_for_selector("#stop:disabled", state="attached", timeout=5_000)
            assert page.evaluate("playback") is None
            page.evaluate("document.getElementById('player').pause()")

            page.fill("#tts_text", "  ")  # the OpenAI route's error, in its own shape, shown the same
            page.click("#speak")
            page.wait_for_selector(RUN_ENDED, state="attached", timeout=30_000)
            assert page.text_content("#error") == "400: input is empty"

            page.select_option("#mode", "instruct2")  # no instruction: the browser asks for one
            page.fill("#instruct_text", "")
            page.fill("#tts_text", SHORT)
            assert page.evaluate("document.getElementById('synth').checkValidity()") is False
            assert page.evaluate("document.getElementById('instruct_text').validity.valueMissing") is True

            page.fill("#api_key", "wrong")  # the voices are not listed again: said, and the choice kept
            page.dispatch_event("#api_key", "change")
            page.wait_for_selector("#error:has-text('Voices not listed')", timeout=10_000)
            assert page.text_content("#error") == f"Voices not listed: 401: {MISSING_KEY}"
            assert page.input_value("#voice") == "alloy"
            page.fill("#api_key", API_KEY)
            page.dispatch_event("#api_key", "change")
            page.wait_for_selector("#error:empty", state="attached", timeout=10_000)
            assert page.input_value("#voice") == "alloy"
        finally:
            browser.close()
    samples, rate = sf.read(io.BytesIO(wav), dtype="int16")
    assert rate == 24000 and np.array_equal(samples, expected)
    assert screenshot.stat().st_size > 0
    print(f"screenshot: {screenshot}")
