"""Debian's headless chromium under selenium (no browser download: ``make setup`` installs the
``chromium`` and ``chromium-driver`` packages when it runs as root), and the chat page's screenshot."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

BROWSER, DRIVER = "chromium", "chromedriver"


def missing() -> str | None:
    """Why no headless browser can run here, or None."""
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (the dev extra: pip install -e '.[dev]')"
    absent = [name for name in (BROWSER, DRIVER) if shutil.which(name) is None]
    if absent:
        return f"{' and '.join(absent)} not found: `make setup` installs Debian's chromium and chromium-driver as root"
    return None


@contextmanager
def headless_chromium(width: int = 1000, height: int = 900) -> Iterator[Any]:
    """A selenium driver for Debian's chromium, both named by path so selenium fetches nothing."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which(BROWSER) or BROWSER
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                 f"--window-size={width},{height}"):  # fmt: skip
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=Service(executable_path=shutil.which(DRIVER) or DRIVER))
    try:
        yield driver
    finally:
        driver.quit()


def ask(driver: Any, text: str) -> None:
    """Types ``text`` into the chat page and presses Send."""
    from selenium.webdriver.common.by import By

    box = driver.find_element(By.ID, "prompt")
    box.clear()
    box.send_keys(text)
    driver.find_element(By.ID, "send").click()


def wait_for(driver: Any, condition: Any, timeout_s: float) -> Any:
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout_s, poll_frequency=0.05).until(condition)


def status(driver: Any) -> str:
    from selenium.webdriver.common.by import By

    return driver.find_element(By.ID, "status").text


def chat_screenshot(url: str, prompt: str, path: Path, timeout_s: float = 120.0) -> Path:
    """The chat page after one streamed reply to ``prompt``, as a PNG at ``path``."""
    with headless_chromium() as driver:
        driver.get(url)
        wait_for(driver, lambda d: d.execute_script("return model !== null"), timeout_s)
        ask(driver, prompt)
        wait_for(driver, lambda d: status(d).startswith(("finish", "error")), timeout_s)
        path.parent.mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(str(path))
    return path
