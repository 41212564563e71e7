"""Drive the page (docs/ui.md) in Debian's headless chromium through Selenium and Debian's
chromedriver: the browser test and tools/ui_first_paint.py share it.

Selenium Manager never runs (it would download a browser or a driver): the driver's path is given and
SE_OFFLINE is set. Nothing here is faked: a real browser loads the real page from a real server.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
PANELS = ("panel-chat", "panel-turns", "panel-chart", "panel-store", "panel-events", "panel-state")
DESKTOP = (1280, 1000)
PHONE = (360, 800)


def missing() -> str | None:
    """Why the browser cannot run here (None: it can)."""
    for path in (CHROMIUM, CHROMEDRIVER):
        if not os.access(path, os.X_OK):
            return f"{path} is not installed (make test-deps installs Debian's chromium and chromium-driver)"
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (the test extra)"
    return None


def start_browser(download_dir: Path | None = None):
    os.environ["SE_OFFLINE"] = "true"  # Selenium Manager must not download anything
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--no-first-run", "--disable-extensions", f"--window-size={DESKTOP[0]},{DESKTOP[1]}"):
        opts.add_argument(arg)
    if download_dir is not None:
        opts.add_experimental_option("prefs", {"download.default_directory": str(download_dir),
                                               "download.prompt_for_download": False})
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=opts, service=Service(executable_path=CHROMEDRIVER))
    driver.set_page_load_timeout(60)
    driver.set_script_timeout(60)
    if download_dir is not None:
        driver.execute_cdp_cmd("Page.setDownloadBehavior", {"behavior": "allow", "downloadPath": str(download_dir)})
    return driver


def set_viewport(driver, size: tuple[int, int]) -> None:
    """The page's CSS width exactly (a window's size includes what the browser draws around it)."""
    w, h = size
    driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride",
                           {"width": w, "height": h, "deviceScaleFactor": 1, "mobile": w < 600})


def wait_js(driver, script: str, timeout: float = 180, what: str = "condition"):
    """Poll a JS expression (`return ...`) until truthy; returns its value. The deadline bounds a
    hang only (a page waiting on a generation, a restore, a reconnect on a busy machine is slow)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = driver.execute_script(script)
        if v:
            return v
        time.sleep(0.1)
    raise TimeoutError(f"{what} not reached within {timeout}s; browser log: {console(driver)[-10:]}")


def console(driver) -> list[str]:
    try:
        return [e["message"] for e in driver.get_log("browser")]
    except Exception:  # noqa: BLE001 - only for a failure message
        return []


def panel_boxes(driver) -> dict[str, dict]:
    return driver.execute_script(
        "const out = {}; for (const id of arguments[0]) { const r = document.getElementById(id)"
        ".getBoundingClientRect(); out[id] = {x: r.left + scrollX, y: r.top + scrollY, w: r.width, h: r.height}; }"
        " return out;", list(PANELS))


def overlaps(boxes: dict[str, dict]) -> list[tuple[str, str]]:
    """Pairs of panels whose boxes share area (touching edges is not overlapping)."""
    names = list(boxes)
    out = []
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            p, q = boxes[a], boxes[b]
            if min(p["x"] + p["w"], q["x"] + q["w"]) - max(p["x"], q["x"]) > 0.5 and \
                    min(p["y"] + p["h"], q["y"] + q["h"]) - max(p["y"], q["y"]) > 0.5:
                out.append((a, b))
    return out


def full_screenshot(driver, path: Path, width: int) -> None:
    """The whole page at `width` CSS pixels, as one PNG."""
    set_viewport(driver, (width, DESKTOP[1]))  # the height at this width, then all of it
    height = driver.execute_script("return document.documentElement.scrollHeight")
    for _ in range(5):  # a panel sized by the window's height (the desktop chat) changes it: again
        set_viewport(driver, (width, height))
        now = driver.execute_script("return document.documentElement.scrollHeight")
        if now == height:
            break
        height = now
    time.sleep(0.3)
    path.write_bytes(driver.get_screenshot_as_png())
