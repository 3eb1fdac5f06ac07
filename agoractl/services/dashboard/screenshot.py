"""A screenshot of the Dashboard's page (``agoractl launch dashboard FILE --screenshot PNG``, the demo's last
step): Playwright (the ``dev`` extra) driving Debian's headless Chromium, once the page has drawn its data."""

from __future__ import annotations

import os
from pathlib import Path

from agoractl.errors import RuntimeFailure, UsageError

CHROMIUM = "/usr/bin/chromium"


def take(url: str, path: Path, width: int = 1400, timeout_s: float = 60.0) -> Path:
    """Load URL, wait for its first data refresh (and the charts' drawing), write a full-page PNG to PATH."""
    try:
        from playwright.sync_api import Error, sync_playwright
    except ImportError:
        raise UsageError("--screenshot needs playwright", hint="pip install 'agoractl[dev]'") from None
    if not os.access(CHROMIUM, os.X_OK):
        raise RuntimeFailure(f"--screenshot needs {CHROMIUM}", hint="apt-get install -y chromium "
                                                                    "(or `make system-packages`)")
    path.parent.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": width, "height": 1000})
            page.goto(url)
            page.wait_for_function("Number(document.body.dataset.refreshed) >= 1", timeout=timeout_s * 1000)
            page.wait_for_timeout(500)  # plotly draws after the data arrive
            page.screenshot(path=str(path), full_page=True)
        except Error as e:
            raise RuntimeFailure(f"the screenshot of {url} failed: {str(e).splitlines()[0]}") from None
        finally:
            browser.close()
    return path
