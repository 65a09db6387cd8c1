"""Reads the built site as a reader would: every page in headless Chromium, its figures, its console.

Serves the site on 127.0.0.1 (a free port, loopback only), then for every page: it loads, has a title and
text, every ``<img>`` loaded (``naturalWidth > 0``), no code block runs off the column (wider than it
scrolls), no request failed, and nothing was written to the
console as an error or thrown. Screenshots of the landing, benchmark and architecture pages go to the
screenshot folder (``site-check/`` by default, git-ignored). Exit status 0 when every page passes, 1 when
one does not (each problem printed) or the browser fails, 2 when no browser is found.

The browser is driven through the Chrome DevTools Protocol over a pipe (``--remote-debugging-pipe``):
nothing listens on a port but the site itself, and nothing but Chromium is needed. Chromium comes from
Debian's packages (``apt-get install -y chromium``; ``.ci/run`` installs it); set ``CHROMIUM`` to use
another binary.

Usage::

    make docs-check                          # builds the site, then runs this
    python tools/check_site.py site --screenshots site-check
"""

from __future__ import annotations

import argparse
import base64
import functools
import http.server
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
SCREENSHOTS = {"": "landing.png", "benchmarks/": "benchmarks.png", "architecture/": "architecture.png"}
VIEWPORT = (1280, 900)
SCREENSHOT_HEIGHT = 2200  # the top of the page: the landing page's quick start, the benchmark page's figures
TIMEOUT_S = 30.0


def find_browser() -> Optional[str]:
    """The Chromium binary: ``$CHROMIUM`` if set, else the first of :data:`BROWSERS` on the ``PATH``."""
    if os.environ.get("CHROMIUM"):
        return os.environ["CHROMIUM"]
    return next((path for path in map(shutil.which, BROWSERS) if path), None)


class BrowserError(Exception):
    """Chromium did not start, did not answer, or answered a command with an error."""


class Browser:
    """Headless Chromium spoken to over the DevTools pipe: commands by id, events kept until taken."""

    def __init__(self, binary: str) -> None:
        self._profile = tempfile.mkdtemp(prefix="check-site-")
        self._log = open(os.path.join(self._profile, "chromium.log"), "w+b")  # quoted if Chromium dies
        to_browser, self._write = os.pipe()  # Chromium reads commands on its fd 3 ...
        self._read, from_browser = os.pipe()  # ... and writes replies and events on its fd 4.

        def plumb() -> None:  # in the child, before exec: fds 3 and 4 are what the pipe protocol reads
            a, b = os.dup(to_browser), os.dup(from_browser)  # out of the way of 3 and 4 first
            os.dup2(a, 3)  # inheritable; Python's own fds are not (PEP 446), so they close at exec
            os.dup2(b, 4)

        # --no-sandbox: Chromium refuses to start as root (CI) with its sandbox; the pages are our own files.
        flags = ["--headless=new", "--remote-debugging-pipe", "--no-sandbox", "--disable-gpu",
                 "--disable-dev-shm-usage", "--no-first-run", "--no-default-browser-check",
                 "--disable-extensions", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--hide-scrollbars", "--mute-audio", f"--user-data-dir={self._profile}"]
        self._process = subprocess.Popen([binary, *flags, "about:blank"], preexec_fn=plumb, close_fds=False,
                                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                         stderr=self._log, start_new_session=True)
        os.close(to_browser)
        os.close(from_browser)
        self._next_id = 0
        self._replies: dict[int, dict] = {}
        self._events: list[dict] = []
        self._changed = threading.Condition()
        self._reader = threading.Thread(target=self._read_messages, daemon=True)
        self._reader.start()

    def _read_messages(self) -> None:
        buffer = b""
        while chunk := os.read(self._read, 1 << 16):
            buffer += chunk
            *messages, buffer = buffer.split(b"\0")
            with self._changed:
                for message in map(json.loads, messages):
                    if "id" in message:
                        self._replies[message["id"]] = message
                    else:
                        self._events.append(message)
                self._changed.notify_all()
        with self._changed:  # the browser went away: wake whoever waits
            self._replies[-1] = {}
            self._changed.notify_all()

    def send(self, method: str, params: Optional[dict] = None, session: Optional[str] = None) -> dict:
        """Run one DevTools command and return its result; raises :class:`BrowserError` on an error or timeout."""
        self._next_id += 1
        message: dict[str, Any] = {"id": self._next_id, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = session
        try:
            os.write(self._write, json.dumps(message).encode() + b"\0")
        except BrokenPipeError:
            raise BrowserError(f"{method}: {self._exited()}") from None
        with self._changed:
            if not self._changed.wait_for(lambda: self._next_id in self._replies or -1 in self._replies, TIMEOUT_S):
                raise BrowserError(f"{method}: no answer from Chromium in {TIMEOUT_S:.0f} s")
            reply = self._replies.pop(self._next_id, None)
        if reply is None:
            raise BrowserError(f"{method}: {self._exited()}")
        if "error" in reply:
            raise BrowserError(f"{method}: {reply['error'].get('message')}")
        return reply.get("result", {})

    def wait_event(self, method: str, session: str) -> dict:
        """The first event ``method`` of ``session`` not yet taken (it stays in :meth:`take_events`)."""
        def found() -> Optional[dict]:
            return next((e for e in self._events if e["method"] == method and e.get("sessionId") == session), None)

        with self._changed:
            if not self._changed.wait_for(lambda: found() is not None or -1 in self._replies, TIMEOUT_S):
                raise BrowserError(f"no {method} from Chromium in {TIMEOUT_S:.0f} s")
            event = found()
        if event is None:
            raise BrowserError(f"waiting for {method}: {self._exited()}")
        return event

    def _exited(self) -> str:
        """Why Chromium is gone: its exit status and the end of what it wrote to stderr."""
        self._log.seek(0)
        said = self._log.read().decode(errors="replace").strip().splitlines()[-5:]
        return f"Chromium exited (status {self._process.poll()}): " + (" | ".join(said) or "it said nothing")

    def take_events(self) -> list[dict]:
        with self._changed:
            events, self._events = self._events, []
        return events

    def close(self) -> None:
        try:
            self.send("Browser.close")
        except (BrowserError, OSError):
            pass  # already gone: the process is reaped below either way
        try:
            self._process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(self._process.pid, signal.SIGKILL)  # our own session: Chromium and its helpers
            self._process.wait()
        os.close(self._write)
        self._reader.join(timeout=5)
        os.close(self._read)
        self._log.close()
        shutil.rmtree(self._profile, ignore_errors=True)


@dataclass
class PageReport:
    url: str
    title: str = ""
    images: int = 0
    problems: list = field(default_factory=list)


def serve(site: Path) -> http.server.ThreadingHTTPServer:
    """The site on 127.0.0.1, on a free port, in a daemon thread, logging nothing."""
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(site)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def pages(site: Path) -> list[str]:
    """Every page of the built site, as a path under its root ("" for the landing page, "api/"…)."""
    found = []
    for html in sorted(site.rglob("*.html")):
        relative = html.relative_to(site).as_posix()
        if relative == "404.html":
            continue
        found.append(relative[: -len("index.html")] if relative.endswith("index.html") else relative)
    return found


_READ_PAGE = """
(async () => {
  await Promise.all([...document.images].map(img => img.complete ? null :
      new Promise(done => { img.addEventListener('load', done); img.addEventListener('error', done); })));
  const article = document.querySelector('article') || document.body;
  return {title: document.title, heading: (article.querySelector('h1') || {}).textContent || '',
          text: article.innerText.trim().length,
          images: [...document.images].map(img => ({src: img.currentSrc || img.src, width: img.naturalWidth})),
          overflowing: [...article.querySelectorAll('pre > code')]
              .filter(code => code.scrollWidth > code.clientWidth + 1)
              .map(code => code.innerText.split('\\n')[0].slice(0, 60))};
})()
"""


def _browsers_own(url: str) -> bool:
    """Chromium asks for /favicon.ico on its own where a page declares no icon, whenever it chooses (before or after
    the check has read the page's events): the browser's request, not the page's."""
    return urllib.parse.urlsplit(url).path == "/favicon.ico"


def _problems_in(events: list[dict]) -> list[str]:
    """Console errors, uncaught exceptions, failed requests and error statuses among a page's events."""
    problems = []
    for event in events:
        method, params = event["method"], event.get("params", {})
        if method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
            text = " ".join(str(arg.get("value", arg.get("description", ""))) for arg in params.get("args", []))
            problems.append(f"console.{params['type']}: {text}")
        elif method == "Runtime.exceptionThrown":
            details = params.get("exceptionDetails", {})
            problems.append(f"uncaught: {details.get('exception', {}).get('description') or details.get('text')}")
        elif method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error" \
                and not _browsers_own(params["entry"].get("url", "")):
            entry = params["entry"]
            problems.append(f"console ({entry.get('source')}): {entry.get('text')} {entry.get('url', '')}".strip())
        elif method == "Network.loadingFailed" and not params.get("canceled"):
            problems.append(f"request failed: {params.get('errorText')} (request {params.get('requestId')})")
        elif method == "Network.responseReceived" and params["response"].get("status", 200) >= 400 \
                and not _browsers_own(params["response"].get("url", "")):
            problems.append(f"HTTP {params['response']['status']}: {params['response'].get('url')}")
    return problems


def check_page(browser: Browser, session: str, url: str) -> PageReport:
    report = PageReport(url)
    navigation = browser.send("Page.navigate", {"url": url}, session)
    if navigation.get("errorText"):
        report.problems.append(f"navigation failed: {navigation['errorText']}")
        return report
    browser.wait_event("Page.loadEventFired", session)
    result = browser.send("Runtime.evaluate", {"expression": _READ_PAGE, "awaitPromise": True,
                                               "returnByValue": True}, session)
    page = result.get("result", {}).get("value") or {}
    report.title, report.images = page.get("title", ""), len(page.get("images", []))
    if not page.get("heading", "").strip() or page.get("text", 0) < 20:
        report.problems.append("no heading or no text: the page did not render")
    report.problems += [f"figure did not load: {img['src']}" for img in page.get("images", []) if img["width"] <= 0]
    report.problems += [f"code block runs off the column: {first!r}" for first in page.get("overflowing", [])]
    time.sleep(0.2)  # let the last console messages of the load arrive (later ones: see check_site)
    report.problems += _problems_in(browser.take_events())
    return report


def screenshot(browser: Browser, session: str, path: Path) -> None:
    """The top of the current page, :data:`SCREENSHOT_HEIGHT` pixels at most, as a PNG."""
    metrics = browser.send("Page.getLayoutMetrics", {}, session)
    height = min(int(metrics["cssContentSize"]["height"]), SCREENSHOT_HEIGHT)
    clip = {"x": 0, "y": 0, "width": VIEWPORT[0], "height": height, "scale": 1}
    shot = browser.send("Page.captureScreenshot", {"format": "png", "clip": clip, "captureBeyondViewport": True},
                        session)
    path.write_bytes(base64.b64decode(shot["data"]))


def check_site(site: Path, shots: Path, binary: str) -> list[PageReport]:
    """Every page of ``site`` checked in Chromium; screenshots of :data:`SCREENSHOTS` saved under ``shots``."""
    server = serve(site)
    base = f"http://127.0.0.1:{server.server_address[1]}/"
    browser = Browser(binary)
    try:
        target = browser.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = browser.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        for domain in ("Page", "Runtime", "Log", "Network"):
            browser.send(f"{domain}.enable", {}, session)
        browser.send("Emulation.setDeviceMetricsOverride", {"width": VIEWPORT[0], "height": VIEWPORT[1],
                                                            "deviceScaleFactor": 1, "mobile": False}, session)
        shots.mkdir(parents=True, exist_ok=True)
        browser.take_events()  # about:blank's
        reports: list[PageReport] = []
        for page in pages(site):
            if reports:  # what a page logged after its check, before the next navigation, is still its own
                reports[-1].problems += _problems_in(browser.take_events())
            reports.append(check_page(browser, session, base + page))
            if page in SCREENSHOTS:
                screenshot(browser, session, shots / SCREENSHOTS[page])
        if reports:
            time.sleep(0.5)
            reports[-1].problems += _problems_in(browser.take_events())
        return reports
    finally:
        browser.close()
        server.shutdown()
        server.server_close()


def main(argv: Optional[list] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("site", type=Path, help="the built site (mkdocs build's site_dir)")
    parser.add_argument("--screenshots", type=Path, default=Path("site-check"), help="where screenshots go")
    args = parser.parse_args(argv)
    binary = find_browser()
    if binary is None:
        print(f"no Chromium found (looked for $CHROMIUM, {', '.join(BROWSERS)}): apt-get install -y chromium",
              file=sys.stderr)
        return 2
    if not (args.site / "index.html").is_file():
        print(f"{args.site} holds no built site (no index.html): run `make docs` first", file=sys.stderr)
        return 1
    started = time.perf_counter()
    try:
        reports = check_site(args.site, args.screenshots, binary)
    except BrowserError as error:
        print(f"the browser failed, so no page was checked: {error}", file=sys.stderr)
        return 1
    for report in reports:
        status = "ok  " if not report.problems else "FAIL"
        print(f"{status} {report.url}  ({report.images} figures) {report.title}")
        for problem in report.problems:
            print(f"     {problem}")
    failed = [r for r in reports if r.problems]
    print(f"{len(reports) - len(failed)} of {len(reports)} pages passed in {time.perf_counter() - started:.1f} s; "
          f"screenshots in {args.screenshots}/")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
