"""/docs: Swagger UI over /openapi.json, served by the API itself (no CDN), over real HTTP from gunicorn."""

from __future__ import annotations

import re
import shutil
import subprocess
from html.parser import HTMLParser

import pytest
import requests

BROWSERS = ("chromium", "chromium-browser", "chromium-headless-shell", "google-chrome")


class Assets(HTMLParser):
    """The stylesheet, icon and script URLs of a page, and its inline scripts."""

    def __init__(self):
        super().__init__()
        self.urls: list[str] = []
        self.inline: list[str] = []
        self._in_script = False

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        url = attrs.get("src") or (attrs.get("href") if tag == "link" else None)
        if url:
            self.urls.append(url)
        self._in_script = tag == "script" and "src" not in attrs

    def handle_data(self, data):
        if self._in_script:
            self.inline.append(data)


def test_docs_page_and_all_its_assets_load_from_the_api(server):
    page = requests.get(f"{server}/docs", timeout=10)
    assert page.status_code == 200 and page.headers["Content-Type"].startswith("text/html")
    assets = Assets()
    assets.feed(page.text)
    assert {url.rsplit("/", 1)[-1] for url in assets.urls} >= {"swagger-ui.css", "swagger-ui-bundle.js"}
    for url in assets.urls:
        assert url.startswith("/docs/static/"), f"{url}: the page must load nothing from elsewhere"
        asset = requests.get(server + url, timeout=10)
        assert asset.status_code == 200 and len(asset.content) > 1000, url
    bundle = requests.get(f"{server}/docs/static/swagger-ui-bundle.js", timeout=10)
    assert "javascript" in bundle.headers["Content-Type"] and "SwaggerUIBundle" in bundle.text

    (spec_url,) = re.findall(r'url: "([^"]+)"', "".join(assets.inline))
    assert spec_url == "/openapi.json"
    spec = requests.get(server + spec_url, timeout=10).json()
    assert spec["openapi"].startswith("3.1") and "/jobs" in spec["paths"]
    assert requests.get(f"{server}/docs/", timeout=10).status_code == 200


@pytest.mark.skipif(
    not any(shutil.which(b) for b in BROWSERS),
    reason="no headless Chromium on this machine (apt install chromium)",
)
def test_docs_render_every_operation_in_a_headless_browser(server, tmp_path):
    """Chromium runs the page's JavaScript, which fetches /openapi.json and renders each operation."""
    browser = next(shutil.which(b) for b in BROWSERS if shutil.which(b))
    common = [
        browser,
        "--headless",
        "--no-sandbox",  # tests may run as root
        "--disable-gpu",
        f"--user-data-dir={tmp_path / 'profile'}",
        "--virtual-time-budget=15000",  # let the page fetch and render before the DOM is read
        "--window-size=1280,1600",
    ]
    dom = subprocess.run(
        [*common, "--dump-dom", f"{server}/docs"], capture_output=True, text=True, timeout=120
    )
    assert dom.returncode == 0, dom.stderr[-2000:]
    spec = requests.get(f"{server}/openapi.json", timeout=10).json()
    rendered = re.sub(r"\s+", " ", dom.stdout)
    assert "swagger-ui" in rendered and "Authorize" in rendered, rendered[-2000:]
    for path, operations in spec["paths"].items():
        for method, op in operations.items():
            assert op["summary"] in rendered, (method, path)
            assert f'data-path="{path}"' in rendered, (method, path)

    shot = tmp_path / "docs.png"
    subprocess.run(
        [*common, f"--screenshot={shot}", f"{server}/docs"], capture_output=True, timeout=120, check=True
    )
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000
