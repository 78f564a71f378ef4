"""Headless Chromium driven over the DevTools protocol on a pipe (`--remote-debugging-pipe`:
JSON messages ending in a NUL byte on file descriptors 3 and 4), with no client library: open
a page, wait until its script says it is ready, evaluate expressions in it (the DOM, computed
styles, element boxes) and take screenshots."""

from __future__ import annotations

import base64
import contextlib
import fcntl
import json
import os
import select
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest


def chromium() -> str | None:
    return next((p for p in map(shutil.which, ("chromium", "chromium-browser",
                                               "google-chrome")) if p), None)


def needs_chromium(test):
    """A test that drives headless Chromium: skipped where none is installed (CI installs
    one), and in the slow layer (a browser's start and each page's render take seconds)."""
    test = pytest.mark.skipif(chromium() is None, reason="needs chromium (CI installs it)")(test)
    return pytest.mark.slow(test)


class BrowserError(RuntimeError):
    pass


class Browser:
    """One headless Chromium process; `open(url)` gives a page session in a new tab."""

    def __init__(self, width: int = 1280, height: int = 1600) -> None:
        self.width, self.height = width, height
        self._profile = tempfile.TemporaryDirectory(prefix="tally-chromium-")
        to_child_r, self._to_child = os.pipe()
        self._from_child, from_child_w = os.pipe()

        # The child reads commands on fd 3 and writes answers on fd 4. Bash puts them there
        # before it execs Chromium (dash takes no fd above 9 in a redirection): a preexec_fn
        # would run Python between fork and exec, which can deadlock in a test process that
        # JAX's threads share. The pipe ends are first moved to fd 10 or above, out of the way
        # of 3 and 4.
        a = fcntl.fcntl(to_child_r, fcntl.F_DUPFD_CLOEXEC, 10)
        b = fcntl.fcntl(from_child_w, fcntl.F_DUPFD_CLOEXEC, 10)
        self.proc = subprocess.Popen(
            ["/bin/bash", "-c", f'exec "$@" 3<&{a} 4>&{b} {a}<&- {b}>&-', "bash", chromium(),
             "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
             "--no-first-run", "--disable-background-networking", "--disable-component-update",
             "--disable-sync", "--disable-extensions", "--hide-scrollbars",
             "--remote-debugging-pipe", f"--user-data-dir={self._profile.name}",
             f"--window-size={width},{height}", "about:blank"],
            pass_fds=(a, b), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for fd in (a, b, to_child_r, from_child_w):
            os.close(fd)
        self._buf = b""
        self._id = 0

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        with contextlib.suppress(BrowserError, OSError):
            self.send("Browser.close", timeout=10)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        for fd in (self._to_child, self._from_child):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._profile.cleanup()

    def send(self, method: str, params: dict | None = None, session: str | None = None,
             timeout: float = 30) -> dict:
        self._id += 1
        msg: dict[str, Any] = {"id": self._id, "method": method, "params": params or {}}
        if session is not None:
            msg["sessionId"] = session
        os.write(self._to_child, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            for m in self._messages(deadline):
                if m.get("id") == self._id:
                    if "error" in m:
                        raise BrowserError(f"{method}: {m['error']}")
                    return m.get("result", {})

    def _messages(self, deadline: float):
        while b"\0" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._from_child], [], [], left)[0]:
                raise BrowserError("chromium did not answer in time")
            chunk = os.read(self._from_child, 1 << 20)
            if not chunk:
                raise BrowserError("chromium closed its pipe")
            self._buf += chunk
        *done, self._buf = self._buf.split(b"\0")
        return [json.loads(m) for m in done]

    def open(self, url: str, ready: str = "document.readyState === 'complete'",
             timeout: float = 30) -> Page:
        """A new tab at `url`, once the JavaScript expression `ready` is true there."""
        target = self.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.send("Target.attachToTarget", {"targetId": target,
                                                      "flatten": True})["sessionId"]
        page = Page(self, session)
        page.send("Emulation.setDeviceMetricsOverride", {
            "width": self.width, "height": self.height, "deviceScaleFactor": 1,
            "mobile": False})
        page.send("Page.navigate", {"url": url})
        page.wait(ready, timeout)
        return page


class Page:
    def __init__(self, browser: Browser, session: str) -> None:
        self.browser, self.session = browser, session

    def send(self, method: str, params: dict | None = None, timeout: float = 30) -> dict:
        return self.browser.send(method, params, self.session, timeout)

    def eval(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (JSON-able values)."""
        r = self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True,
                                           "awaitPromise": True})
        if "exceptionDetails" in r:
            raise BrowserError(f"{expression[:80]}: {r['exceptionDetails']}")
        return r["result"].get("value")

    def wait(self, expression: str, timeout: float = 30) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            try:
                v = self.eval(expression)
            except BrowserError:
                v = None
            if v or time.monotonic() > deadline:
                if not v:
                    raise BrowserError(f"never true: {expression}")
                return v
            time.sleep(0.1)

    def screenshot(self, path: str | Path) -> Path:
        """The whole page as a PNG (for a person to look at; tests do not commit them)."""
        size = self.eval("[document.documentElement.scrollWidth,"
                         " document.documentElement.scrollHeight]")
        data = self.send("Page.captureScreenshot", {
            "format": "png", "captureBeyondViewport": True,
            "clip": {"x": 0, "y": 0, "width": size[0], "height": size[1], "scale": 1}})["data"]
        Path(path).write_bytes(base64.b64decode(data))
        return Path(path)
