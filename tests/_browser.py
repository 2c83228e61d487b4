"""A real headless Chromium driven over the DevTools protocol (aiohttp's websocket client, a core
dependency): open a page, wait for what a user would see, click, read the text, take a screenshot.

Chromium is Debian's ``chromium`` package (``.ci/run`` installs it like PostgreSQL). A machine
without it fails the test that needs it with a message saying how to install it; it never skips.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp
import pytest

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome")


def chromium_binary() -> str:
    """The Chromium executable, or a test failure naming the fix (never a skip)."""
    for name in CHROMIUM_NAMES:
        found = shutil.which(name)
        if found:
            return found
    pytest.fail("headless Chromium is needed for the MLflow UI test and is not installed: "
                "`apt-get install chromium` (Debian; .ci/run installs it when missing)", pytrace=False)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Browser:
    """One headless Chromium with one page, bound to 127.0.0.1."""

    def __init__(self, width: int = 1400, height: int = 900) -> None:
        self.port = free_port()
        self.profile = tempfile.mkdtemp(prefix="servetune-chromium-")
        argv = [chromium_binary(), "--headless=new", "--disable-gpu", "--disable-dev-shm-usage",
                "--no-first-run", "--no-default-browser-check", f"--user-data-dir={self.profile}",
                f"--remote-debugging-port={self.port}", "--remote-debugging-address=127.0.0.1",
                f"--window-size={width},{height}", "about:blank"]
        # No sandbox: Chromium refuses its sandbox as root and, in containers without user
        # namespaces, for anyone; this browser only visits the test's own server on 127.0.0.1.
        argv.insert(1, "--no-sandbox")
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.loop = asyncio.new_event_loop()
        self._ids = itertools.count(1)
        ws_url = self._page_ws_url()
        self.session = self.loop.run_until_complete(self._open_session())
        self.ws = self.loop.run_until_complete(self.session.ws_connect(ws_url, max_msg_size=0))
        self.call("Page.enable")
        self.call("Runtime.enable")

    def _page_ws_url(self) -> str:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"chromium exited with {self.proc.returncode}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/json/list", timeout=2) as r:
                    pages = [t for t in json.load(r) if t.get("type") == "page"]
                if pages:
                    return str(pages[0]["webSocketDebuggerUrl"])
            except OSError:
                pass
            time.sleep(0.3)
        raise RuntimeError("chromium's DevTools endpoint did not come up in 60 s")

    async def _open_session(self) -> aiohttp.ClientSession:
        return aiohttp.ClientSession()

    async def _call(self, method: str, params: dict[str, Any]) -> dict[str, Any]:
        msg_id = next(self._ids)
        await self.ws.send_json({"id": msg_id, "method": method, "params": params})
        while True:
            msg = await self.ws.receive_json(timeout=120)
            if msg.get("id") == msg_id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return dict(msg.get("result", {}))

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        return self.loop.run_until_complete(self._call(method, params))

    def eval(self, expression: str) -> Any:
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"page script failed: {result['exceptionDetails']}")
        return result.get("result", {}).get("value")

    def goto(self, url: str) -> None:
        self.call("Page.navigate", url=url)

    def text(self) -> str:
        return str(self.eval("document.body ? document.body.innerText : ''"))

    def wait_for_text(self, *needles: str, timeout_s: float = 60.0) -> str:
        """The page's visible text once it holds every needle; a failure shows what it held."""
        deadline = time.monotonic() + timeout_s
        text = ""
        while time.monotonic() < deadline:
            text = self.text()
            if all(n in text for n in needles):
                return text
            time.sleep(0.5)
        missing = [n for n in needles if n not in text]
        raise AssertionError(f"page never showed {missing}; it showed:\n{text[:3000]}")

    def click_text(self, label: str) -> None:
        """Click the innermost visible element whose own text is ``label``."""
        found = self.eval(f"""(() => {{
            const want = {json.dumps(label)};
            const all = [...document.querySelectorAll('a, button, span, div, td')];
            const hit = all.filter(e => e.innerText && e.innerText.trim() === want && e.offsetParent !== null)
                           .sort((a, b) => a.innerText.length - b.innerText.length || b.querySelectorAll('*').length - a.querySelectorAll('*').length)
                           .pop();
            if (!hit) return false;
            hit.scrollIntoView(); hit.click(); return true; }})()""")
        if not found:
            raise AssertionError(f"nothing to click labelled {label!r} on the page:\n{self.text()[:2000]}")

    def click_css(self, selector: str, timeout_s: float = 30.0) -> None:
        """Click the first element matching a CSS selector, once the page has rendered one.

        Waits: a page may show its text (MLflow's "9 matching runs") before the table rows it
        counts, and on a loaded machine the rows can follow seconds later (a CI run failed there).
        """
        click = (f"(() => {{ const e = document.querySelector({json.dumps(selector)}); "
                 "if (!e) return false; e.scrollIntoView(); e.click(); return true; })()")
        deadline = time.monotonic() + timeout_s
        while not self.eval(click):
            if time.monotonic() >= deadline:
                raise AssertionError(f"no element {selector!r} on the page:\n{self.text()[:2000]}")
            time.sleep(0.5)

    def wait_for_js(self, expression: str, timeout_s: float = 60.0) -> Any:
        """The value of ``expression`` once it is truthy."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            value = self.eval(expression)
            if value:
                return value
            time.sleep(0.5)
        raise AssertionError(f"{expression} stayed false for {timeout_s:.0f} s; the page showed:\n{self.text()[:2000]}")

    def screenshot(self, path: Path) -> Path:
        data = self.call("Page.captureScreenshot", format="png")["data"]
        path.write_bytes(base64.b64decode(data))
        return path

    def close(self) -> None:
        try:
            self.loop.run_until_complete(self.ws.close())
            self.loop.run_until_complete(self.session.close())
        finally:
            self.loop.close()
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=20)
            shutil.rmtree(self.profile, ignore_errors=True)
