"""Open an HTML file in headless Chromium (Debian's `chromium`) over the DevTools protocol on a pipe (no
websocket library, no network): what each <img> decoded to, every console message and page error, and a
screenshot. `python tests/report/browser.py PAGE.html OUT.png [WIDTH HEIGHT]` makes docs/report.png."""

from __future__ import annotations

import base64
import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

CHROMIUM = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)), None)


class Browser:
    def __init__(self) -> None:
        self.profile = tempfile.mkdtemp(prefix="ember-chromium-")
        to_child_r, self._to_child = os.pipe()
        self._from_child, from_child_w = os.pipe()
        # --remote-debugging-pipe: the child reads commands on fd 3 and writes replies on fd 4 (the shell's
        # redirections put our pipe ends there, whatever numbers they have here).
        args = [CHROMIUM, "--headless", "--remote-debugging-pipe", "--no-sandbox", "--disable-gpu", "--no-first-run",
                "--disable-extensions", "--disable-background-networking", f"--user-data-dir={self.profile}",
                "about:blank"]
        self.proc = subprocess.Popen(["bash", "-c", f'exec "$@" 3<&{to_child_r} 4>&{from_child_w}', "chromium", *args],
                                     pass_fds=(to_child_r, from_child_w), stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        os.close(to_child_r)
        os.close(from_child_w)
        self._buffer, self._next_id, self.events = b"", 0, []
        self.session: Optional[str] = None

    def send(self, method: str, params: Optional[dict] = None, timeout: float = 30) -> dict[str, Any]:
        self._next_id += 1
        message: dict[str, Any] = {"id": self._next_id, "method": method, "params": params or {}}
        if self.session and not method.startswith("Target."):
            message["sessionId"] = self.session
        os.write(self._to_child, json.dumps(message).encode() + b"\0")
        reply = self._wait(lambda m: m.get("id") == self._next_id, timeout)
        if "error" in reply:
            raise RuntimeError(f"{method}: {reply['error']}")
        return reply.get("result", {})

    def wait_event(self, method: str, timeout: float = 30) -> dict[str, Any]:
        for event in self.events:
            if event.get("method") == method:
                return event
        return self._wait(lambda m: m.get("method") == method, timeout)

    def _wait(self, match: Any, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            while b"\0" in self._buffer:
                raw, self._buffer = self._buffer.split(b"\0", 1)
                message = json.loads(raw)
                if "method" in message:
                    self.events.append(message)
                if match(message):
                    return message
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._from_child], [], [], left)[0]:
                raise TimeoutError("chromium did not answer")
            chunk = os.read(self._from_child, 1 << 20)
            if not chunk:
                raise RuntimeError("chromium exited")
            self._buffer += chunk

    def open(self, path: Path, width: int = 1200, height: int = 900) -> None:
        target = self.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        self.session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        for domain in ("Page", "Runtime", "Log"):
            self.send(f"{domain}.enable")
        self.send("Emulation.setDeviceMetricsOverride", {"width": width, "height": height, "deviceScaleFactor": 1,
                                                          "mobile": False})
        self.events.clear()
        self.send("Page.navigate", {"url": Path(path).resolve().as_uri()})
        self.wait_event("Page.loadEventFired")

    def evaluate(self, expression: str) -> Any:
        return self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True})["result"].get("value")

    def errors(self) -> list[str]:
        """Console errors and warnings, uncaught exceptions, and failed loads the browser logged."""
        out = []
        for event in self.events:
            method, params = event.get("method"), event.get("params", {})
            if method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "warning", "assert"):
                out.append(f"console.{params['type']}: {params.get('args')}")
            elif method == "Runtime.exceptionThrown":
                out.append(f"exception: {params.get('exceptionDetails')}")
            elif method == "Log.entryAdded" and params.get("entry", {}).get("level") in ("error", "warning"):
                out.append(f"log: {params['entry'].get('text')} {params['entry'].get('url', '')}")
        return out

    def screenshot(self, out: Path, full_page: bool = False) -> None:
        params: dict[str, Any] = {"format": "png"}
        if full_page:
            params["captureBeyondViewport"] = True
        Path(out).write_bytes(base64.b64decode(self.send("Page.captureScreenshot", params)["data"]))

    def close(self) -> None:
        try:
            self.send("Browser.close", timeout=5)
        except (RuntimeError, TimeoutError, OSError):
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self._to_child)
        os.close(self._from_child)
        shutil.rmtree(self.profile, ignore_errors=True)


if __name__ == "__main__":
    page, out = Path(sys.argv[1]), Path(sys.argv[2])
    size = (int(sys.argv[3]), int(sys.argv[4])) if len(sys.argv) > 4 else (1200, 1700)
    browser = Browser()
    try:
        browser.open(page, *size)
        browser.screenshot(out)
    finally:
        browser.close()
    print(f"wrote {out} ({size[0]} x {size[1]})")
