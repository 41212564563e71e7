"""The page (docs/ui.md) in a real headless chromium against a real server on the default model.

One server's life and restart, as the lab runs it with the page (docs/lab-a.md): a streamed chat
turn is a cold row in the turns table; SIGTERM, start again on the same kv dir; "Resend
conversation" restores the prefix from disk (cached_tokens > 0, source disk), the store view lists
the snapshot, the chart has a cold and a restored point, the live events show the restore and the new
process's start-up (the stream's backlog). The layout holds at 360 and 1280 CSS pixels, and reads
as a product there: labels, not API field names; sizes in KiB/MiB/GiB; the store's first words
whole; a cold turn without a realignment figure; the chat as high as a desktop window. A second server with `api_key_file`: the page asks for the
key, a wrong key is refused and shows nothing, the right one shows the state.

Browser: Debian's chromium + chromedriver (make test-deps); skipped, saying so, where they are absent.
EDGE_LLM_UI_SCREENSHOT=<png> also writes the desktop screenshot there (docs/ui.png is made this way).
"""

from __future__ import annotations

import os
import re
import signal
import struct
import time
from pathlib import Path

import pytest
import uibrowser as ub
from serverutil import ServerProc, wait_for

pytestmark = pytest.mark.skipif(ub.missing() is not None, reason=str(ub.missing()))

# A system prompt longer than two prefill chunks (128 rows): a restored prefix is cut back to a
# chunk boundary (docs/store.md "Restore and recompute"), so a shorter one would restore nothing.
SYSTEM = ("You are the lab assistant of a class that runs a small language model on an RK3588 board. "
          "The board has eight CPU cores, an NPU and an eMMC disk. The server keeps the KV cache of the "
          "last conversation in RAM and writes a snapshot of it to the disk after every request, so that "
          "a restarted server reads the prefix back instead of computing it again. ") * 3
QUESTION = "Where does the server write its snapshots?"
# shares its first words with SYSTEM, fewer than a prefill chunk: a cold turn whose matched rows
# were given up (timings.align_rows > 0), which the page does not show as a realignment
OTHER_SYSTEM = "You are the lab assistant of a class that runs a small language model. It is late."
UNIT = r"^\d+(\.\d)? (B|KiB|MiB|GiB|TiB)$"
# the API's field names as the page used to print them (docs/ui.md "Words and units")
RAW = ("memory.", "settings.", "events.", "cost gate mode", "cost gate decisions", "limit max", "restored bytes",
       "backend_reason", "max_seq", "queue_depth", "formula")


@pytest.fixture
def browser(tmp_path):
    driver = ub.start_browser(download_dir=tmp_path / "downloads")
    yield driver
    driver.quit()


def text(driver, css: str) -> str:
    return driver.execute_script("const e = document.querySelector(arguments[0]); return e ? e.textContent : ''", css)


def turn_rows(driver) -> list[dict]:
    return driver.execute_script(
        "return [...document.querySelectorAll('#turns tbody tr')].map(tr => Object.fromEntries("
        "[...tr.cells].map(td => [td.dataset.col, td.textContent])))")


def canvas_colours(driver) -> dict[str, int]:
    """Pixels of each series' colour on the chart canvas (what was drawn, not the data attributes)."""
    return driver.execute_script("""
        const c = document.getElementById('chart'), d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
        const want = {cold: [0x1f, 0x6f, 0xb4], restored: [0xd9, 0x48, 0x0f]}, out = {cold: 0, restored: 0};
        for (let i = 0; i < d.length; i += 4) for (const [k, [r, g, b]] of Object.entries(want))
            if (Math.abs(d[i] - r) < 3 && Math.abs(d[i + 1] - g) < 3 && Math.abs(d[i + 2] - b) < 3) out[k]++;
        return out;""")


def check_layout(driver, size: tuple[int, int]) -> dict:
    ub.set_viewport(driver, size)
    assert driver.execute_script("return innerWidth") == size[0]
    boxes = ub.panel_boxes(driver)
    for name, b in boxes.items():
        assert b["w"] > 0 and b["h"] > 0, (size, name, b)
        assert b["x"] >= 0 and b["x"] + b["w"] <= size[0] + 0.5, (size, name, b)  # no sideways scrolling
    assert not ub.overlaps(boxes), (size, ub.overlaps(boxes), boxes)
    return boxes


def check_words(driver, size: tuple[int, int]) -> None:
    """What a user reads at this width: labels (no API names), sizes in units, the store's first
    words whole and in view (wrapped, not cut by its scroll box), and at desktop size the chat
    filling the window's height."""
    ub.set_viewport(driver, size)
    driver.execute_script("scrollTo(0, 0)")
    panels = "#panel-state, #panel-store, #panel-turns"
    labels = driver.execute_script(
        "return [...document.querySelectorAll(arguments[0].split(', ').map(p => p + ' dt, ' + p + ' th')"
        ".join(', '))].map(e => e.textContent)", panels)
    assert len(labels) > 30, labels
    assert not [x for x in labels if "_" in x or "." in x], labels
    shown = driver.execute_script("return [...document.querySelectorAll(arguments[0])].map(e => e.innerText)"
                                  ".join('\\n')", panels)
    assert not [r for r in RAW if r in shown], [r for r in RAW if r in shown]
    sizes = driver.execute_script(
        "return [...document.querySelectorAll('#state dd, #store-summary dd')].filter(dd => "
        "/bytes|^memory\\.parts\\./.test(dd.dataset.key)).map(dd => [dd.dataset.key, dd.textContent])"
        ".concat([...document.querySelectorAll('#snapshots td[data-col=bytes], #snapshots td[data-col=formula]')]"
        ".map(td => [td.dataset.col, td.textContent]))")
    assert len(sizes) >= 6, sizes
    assert all(re.match(UNIT, v[:-2] if k.endswith("_per_s") else v) or v in ("no limit", "unknown", "not measured yet")
               for k, v in sizes), sizes
    words = driver.execute_script("""return [...document.querySelectorAll('#snapshots td[data-col=words]')].map(td => {
        const r = td.getBoundingClientRect(), box = td.closest('.scroll').getBoundingClientRect();
        return {text: td.textContent, title: td.title, sw: td.scrollWidth, cw: td.clientWidth,
                left: r.left - box.left, right: box.right - r.right, w: r.width}; })""")
    assert words, "no first-words cell"
    for w in words:
        assert w["text"] and w["title"] == w["text"], (size, w)
        assert w["sw"] <= w["cw"] + 1 and w["left"] >= -1 and w["right"] >= -1 and w["w"] > 100, (size, w)
    if size[0] >= 800:
        chat = driver.execute_script("const r = document.getElementById('panel-chat').getBoundingClientRect(), "
                                     "m = document.getElementById('messages').getBoundingClientRect(), "
                                     "f = document.getElementById('chat-form').getBoundingClientRect(); "
                                     "return {bottom: r.bottom, messages: m.height, form: f.bottom, h: innerHeight}")
        # the chat reaches the window's bottom edge (within the grid's padding) with its input there:
        # the messages take the height between, no empty region under the chat
        assert chat["h"] - 40 <= chat["bottom"] <= chat["h"] + 1, chat
        assert chat["form"] >= chat["bottom"] - 30 and chat["messages"] >= 120, chat


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


@pytest.mark.timeout(1200)  # two server starts and a dozen page waits, on a busy machine: bounds a hang
def test_chat_restart_resend_restores_from_disk(edge_home, tmp_path, browser):
    d = browser
    srv = ServerProc(edge_home, tmp_path / "srv", "--model", "default", "--backend", "cpu").start()
    try:
        d.get(srv.url + "/")  # redirected to /ui/
        assert d.current_url.endswith("/ui/")
        ub.wait_js(d, "return document.querySelector('#state dd[data-key=backend]')?.textContent === 'cpu'",
                   what="the state panel")
        assert not d.find_element("id", "key-form").is_displayed()  # no key on this server: never asked
        assert not d.find_element("id", "image-label").is_displayed()  # a text-only model: no image upload
        d.execute_script("document.querySelector('details.opts').open = true")
        d.find_element("id", "opt-system").send_keys(SYSTEM)
        mx = d.find_element("id", "opt-max")
        mx.clear()
        mx.send_keys("12")
        d.find_element("id", "opt-temp").send_keys("0")
        d.find_element("id", "chat-input").send_keys(QUESTION)
        d.find_element("id", "send").click()
        ub.wait_js(d, "return document.querySelectorAll('#turns tbody tr').length === 1", what="the first turn")
        (cold,) = turn_rows(d)
        assert cold["source"] == "cold" and cold["cached"] == "0" and int(cold["prompt"]) > 256, cold
        answer = text(d, "#messages .msg.assistant .body")
        assert answer.strip(), "no streamed answer"
        assert re.match(r"^\d+ ms$", cold["ttft"]) and re.match(r"^\d+ ms$", cold["prefill"]), cold
        assert cold["draft"] == "0 / 0" and cold["aligned"] == "" and cold["restored"] == "", cold

        # the snapshot is written after the answer: wait for its line, then restart on the same kv dir
        ub.wait_js(d, "return [...document.querySelectorAll('#events li')].some(li => /\\[KV-DISK\\] saved/"
                      ".test(li.textContent))", what="the live [KV-DISK] saved event")
        assert srv.stop(signal.SIGTERM) == 0
        srv.start()
        d.refresh()  # the conversation and its turns come back from localStorage
        ub.wait_js(d, "return document.querySelectorAll('#turns tbody tr').length === 1", what="the kept turn")
        assert text(d, "#messages .msg.assistant .body") == answer
        ub.wait_js(d, "return document.getElementById('events-status').textContent === 'connected' && "
                      "document.querySelector('#state dd[data-key=uptime]')?.textContent !== ''",
                   what="the page reconnected")
        d.find_element("id", "resend").click()
        ub.wait_js(d, "return document.querySelectorAll('#turns tbody tr').length === 2", what="the resent turn")
        restored = turn_rows(d)[1]
        assert restored["source"] == "disk" and int(restored["cached"]) > 0, restored
        assert restored["prompt"] == cold["prompt"] and re.match(UNIT, restored["restored"]), restored
        assert restored["restored"] != "0 B" and re.match(r"^\d+$", restored["aligned"]), restored
        assert len(d.find_elements("css selector", "#messages .msg.assistant")) == 1  # the answer was replaced
        assert text(d, "#messages .msg.assistant .body") == answer  # greedy: the cold run's answer

        # the store lists the snapshot, the live events show the restore, the chart has both points
        d.find_element("id", "store-refresh").click()
        ub.wait_js(d, "return document.querySelectorAll('#snapshots tbody tr').length >= 1", what="the store view")
        files = d.execute_script("return [...document.querySelectorAll('#snapshots td[data-col=file]')]"
                                 ".map(td => td.textContent)")
        assert all(f.startswith("kv_") and f.endswith(".kv") for f in files), files
        ub.wait_js(d, "return [...document.querySelectorAll('#events li')].some(li => /\\[KV-DISK\\] loaded/"
                      ".test(li.textContent))", what="the live [KV-DISK] loaded event")
        # the new process's start-up scan, logged before the page reconnected: from the backlog, once
        index = d.execute_script("return [...document.querySelectorAll('#events li')].map(li => li.textContent)"
                                 ".filter(t => /\\[KV-DISK\\] index: 1 checkpoint/.test(t))")
        assert len(index) == 1, index
        chart = d.find_element("id", "chart")
        assert (chart.get_attribute("data-cold"), chart.get_attribute("data-restored")) == ("1", "1")
        colours = canvas_colours(d)
        assert colours["cold"] > 20 and colours["restored"] > 20, colours

        d.find_element("id", "chart-csv").click()
        csv = _wait_file(tmp_path / "downloads" / "edge-llm-ttft.csv")
        lines = csv.decode().splitlines()
        assert lines[0].startswith("series,prompt_tokens,ttft_ms") and [x.split(",")[0] for x in lines[1:]] == \
            ["cold", "restored"], lines

        d.find_element("id", "chart-png").click()
        png = _wait_file(tmp_path / "downloads" / "edge-llm-ttft.png")
        assert png_size(png) == (int(chart.get_attribute("width")), int(chart.get_attribute("height")))

        # another conversation whose first words match the last one's: cold, its matched rows given
        # up (align_rows > 0 in the response), and the row does not call that a realignment
        d.find_element("id", "conv-new").click()
        d.execute_script("document.querySelector('details.opts').open = true")
        d.find_element("id", "opt-system").send_keys(OTHER_SYSTEM)
        d.find_element("id", "chat-input").send_keys("Who are you?")
        d.find_element("id", "send").click()
        ub.wait_js(d, "return document.querySelectorAll('#turns tbody tr').length === 1", what="the other turn")
        (other,) = turn_rows(d)
        stored = d.execute_script("const db = JSON.parse(localStorage.getItem('edge-llm.conversations')); "
                                  "return db.list.find(c => c.id === db.current).turns[0]")
        assert stored["cache_source"] == "none" and stored["align_rows"] > 0, stored
        assert other["source"] == "cold" and other["aligned"] == "" and other["cached"] == "0", other
        from selenium.webdriver.support.select import Select

        Select(d.find_element("id", "conv-select")).select_by_visible_text(QUESTION[:40])  # back to the first
        ub.wait_js(d, "return document.querySelectorAll('#turns tbody tr').length === 2", what="the first conversation")

        for size in (ub.PHONE, ub.DESKTOP):
            check_layout(d, size)
        for size in (ub.PHONE, (1280, 800)):
            check_words(d, size)
        refused = [m for m in ub.console(d) if "Content Security Policy" in m or "Refused to" in m]
        assert not refused, refused  # the page runs under its CSP without a violation
        phone = tmp_path / "ui-360.png"
        ub.full_screenshot(d, phone, ub.PHONE[0])
        assert png_size(phone.read_bytes())[0] == ub.PHONE[0]
        shot = tmp_path / "ui.png"
        ub.full_screenshot(d, shot, ub.DESKTOP[0])
        assert png_size(shot.read_bytes())[0] == ub.DESKTOP[0]
        if os.environ.get("EDGE_LLM_UI_SCREENSHOT"):
            Path(os.environ["EDGE_LLM_UI_SCREENSHOT"]).write_bytes(shot.read_bytes())
    finally:
        srv.stop()


def _wait_file(path: Path, timeout: float = 180) -> bytes:  # bounds a hang: a busy browser is slow
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.is_file() and path.stat().st_size > 0:
            return path.read_bytes()
        time.sleep(0.1)
    raise TimeoutError(f"{path.name} was not downloaded")


@pytest.mark.timeout(900)  # a server start (600 s allowed) and the page's waits: bounds a hang
def test_key_flow(edge_home, tmp_path, browser):
    d = browser
    (tmp_path / "keys").write_text("right-key\n")
    srv = ServerProc(edge_home, tmp_path / "srv", "--model", "default", "--backend", "cpu", "--no-disk-kv",
                     "--api-key-file", str(tmp_path / "keys")).start()
    try:
        d.get(srv.url + "/ui/")
        ub.wait_js(d, "return !document.getElementById('key-form').hidden", what="the key form")
        assert d.find_element("id", "key-form").is_displayed()
        assert not any(d.find_element("id", p).is_displayed() for p in ub.PANELS)  # nothing shown without it
        assert text(d, "#state") == "" and text(d, "#snapshots tbody") == ""
        d.find_element("id", "key-input").send_keys("wrong-key")
        d.find_element("css selector", "#key-form button[type=submit]").click()
        ub.wait_js(d, "return !document.getElementById('key-error').hidden && "
                      "!document.getElementById('key-form').hidden", what="the refusal")
        assert "refused" in text(d, "#key-error") and text(d, "#state") == ""
        assert not d.find_element("id", "panel-state").is_displayed()
        d.find_element("id", "key-input").send_keys("right-key")
        d.find_element("css selector", "#key-form button[type=submit]").click()
        ub.wait_js(d, "return document.querySelector('#state dd[data-key=backend]')?.textContent === 'cpu'",
                   what="the state with the right key")
        assert d.find_element("id", "key-form").get_attribute("hidden") is not None
        assert not d.find_element("id", "key-form").is_displayed()
        assert all(d.find_element("id", p).is_displayed() for p in ub.PANELS)

        # a refused request: the server's message is shown, the typed message is kept
        d.execute_script("document.querySelector('details.opts').open = true")
        d.find_element("id", "opt-max").clear()
        d.find_element("id", "opt-max").send_keys("999999")
        d.find_element("id", "chat-input").send_keys("Tell me a long story about a board.")
        d.find_element("id", "send").click()
        ub.wait_js(d, "return !document.getElementById('chat-error').hidden", what="the refusal's message")
        assert text(d, "#chat-error").startswith("400: ") and "max_tokens" in text(d, "#chat-error")
        assert "long story" in text(d, "#messages .msg.user") and turn_rows(d) == []

        # chat with the key; Stop aborts the stream and the server cancels the job. As many tokens as
        # the context leaves (a few hundred kept for the prompt): on a busy machine the click can come
        # many tokens after the first one shown, and it must still land before the generation ends
        srv.api_key = "right-key"  # the details of /health (max_seq) need the key
        max_tokens = srv.health().json()["max_seq"] - 256
        assert max_tokens >= 2000, max_tokens
        mark = srv.log_size()
        d.find_element("id", "opt-max").clear()
        d.find_element("id", "opt-max").send_keys(str(max_tokens))
        d.find_element("id", "resend").click()
        ub.wait_js(d, "return document.querySelector('#messages .msg.assistant.streaming .body')?.textContent",
                   what="the streamed answer")
        d.find_element("id", "stop").click()
        ub.wait_js(d, "return !document.getElementById('send').disabled", what="the stop")
        wait_for(lambda: "client disconnected" in srv.log(mark), what="the job's cancel line")
        assert turn_rows(d) == [] and text(d, "#chat-error") == ""  # a stopped request has no turn row
    finally:
        srv.stop()


@pytest.mark.timeout(900)  # a server start (600 s allowed) and the page's waits: bounds a hang
def test_image_upload_for_a_vision_model(edge_home, tiny_synth_dir, tmp_path, browser):
    """A vision model (the tiny random Qwen3-VL: its answer is noise, its image tokens are not): the
    page offers the upload, and the picked image reaches the server as a data: URL image part."""
    from PIL import Image

    picture = tmp_path / "red.png"
    Image.new("RGB", (64, 64), (200, 30, 30)).save(picture)
    d = browser
    srv = ServerProc(edge_home, tmp_path / "srv", "--model", str(tiny_synth_dir), "--backend", "cpu",
                     "--no-disk-kv").start()
    try:
        d.get(srv.url + "/ui/")
        ub.wait_js(d, "return !document.getElementById('image-label').hidden", what="the image upload")
        d.find_element("id", "image-input").send_keys(str(picture))
        mx = d.find_element("id", "opt-max")
        d.execute_script("document.querySelector('details.opts').open = true")
        mx.clear()
        mx.send_keys("4")
        d.find_element("id", "chat-input").send_keys("What is in the picture?")
        d.find_element("id", "send").click()
        ub.wait_js(d, "return document.querySelectorAll('#turns tbody tr').length === 1", what="the image turn")
        (row,) = turn_rows(d)
        assert int(row["image"]) > 0 and int(row["prompt"]) > int(row["image"]), row
        assert "[image]" in text(d, "#messages .msg.user")
    finally:
        srv.stop()
