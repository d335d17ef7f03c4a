"""Headless Chromium for the matrix page: Debian's ``chromium`` and ``chromium-driver``
driven through selenium, nothing downloaded. Used by tests/test_matrix_site_browser.py and,
as a script, by ``nox -s matrix-screenshot`` (docs/matrix-page.png):

    python tests/site_browser.py reports/site/index.html docs/matrix-page.png '#backend=...'

Chromium's own ``--headless --screenshot`` is not enough: it shoots before the page has
decoded its data (an asynchronous decompression), so this waits for ``data-ready``.
"""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path
from typing import Any

WINDOW = (1400, 1000)


def missing() -> str | None:
    """What is missing to drive the browser, or None."""
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (pip install -e '.[dev]')"
    if browser_path() is None or shutil.which("chromedriver") is None:
        return "no Chromium and chromedriver on PATH (apt-get install chromium chromium-driver)"
    return None


def browser_path() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def start() -> Any:
    """A headless Chromium (selenium WebDriver) with a 1400 x 1000 window."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = browser_path() or ""
    # --no-sandbox: CI runs as root, where Chromium refuses its sandbox.
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--hide-scrollbars"):
        options.add_argument(argument)
    options.add_argument(f"--window-size={WINDOW[0]},{WINDOW[1]}")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=options)


def open_page(driver: Any, path: Path, fragment: str = "", timeout_s: float = 15) -> None:
    """Open the page file (with ``#fragment``: filters and a cell) and wait until it has drawn;
    raises when it shows an error or the browser logged one."""
    driver.get(Path(path).resolve().as_uri() + fragment)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ready = driver.execute_script("return document.body.dataset.ready || null")
        if ready:
            if ready != "1":
                raise AssertionError(driver.find_element("id", "about").text)
            errors = [entry for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]
            if errors:
                raise AssertionError(f"the page logged errors: {errors}")
            return
        time.sleep(0.05)
    raise AssertionError(f"the page never finished drawing; browser log: {driver.get_log('browser')}")


def main(argv: list[str]) -> int:
    if len(argv) not in (2, 3):
        print("usage: python tests/site_browser.py PAGE.html SHOT.png ['#filters&cell=...']", file=sys.stderr)
        return 2
    why = missing()
    if why:
        print(f"site_browser: {why}", file=sys.stderr)
        return 2
    driver = start()
    try:
        open_page(driver, Path(argv[0]), argv[2] if len(argv) == 3 else "")
        driver.save_screenshot(argv[1])
    finally:
        driver.quit()
    print(f"site_browser: {argv[1]}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
