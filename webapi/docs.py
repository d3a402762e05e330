"""/docs: an interactive reference of the HTTP API, Swagger UI rendering /openapi.json.

Swagger UI's files come from the swagger-ui-py package (Swagger UI 5, which reads OpenAPI 3.1; only
its files are used, not its Flask integration, which cannot point at /openapi.json) and are served
by the API itself under /docs/static: the page needs no CDN, so it works where the API's users have
no internet access. "Authorize" takes an API key; "Try it out" then sends real requests.
"""

from __future__ import annotations

from flask import Blueprint, render_template_string, url_for
from swagger_ui.utils import SWAGGER_UI_PY_ROOT

ASSETS = SWAGGER_UI_PY_ROOT / "static"
bp = Blueprint("docs", __name__, static_folder=str(ASSETS), static_url_path="/docs/static")

PAGE = """<!doctype html>
<html lang="en">
<head>
  <meta charset="utf-8">
  <title>genq API reference</title>
  <link rel="stylesheet" href="{{ static('swagger-ui.css') }}">
  <link rel="icon" type="image/png" href="{{ static('favicon-32x32.png') }}">
</head>
<body>
  <div id="swagger-ui"></div>
  <script src="{{ static('swagger-ui-bundle.js') }}"></script>
  <script>
    window.ui = SwaggerUIBundle({
      url: {{ spec_url|tojson }},
      dom_id: "#swagger-ui",
      deepLinking: true,
      persistAuthorization: true,
      presets: [SwaggerUIBundle.presets.apis],
    });
  </script>
</body>
</html>
"""


@bp.get("/docs", strict_slashes=False)
def docs():
    """The API reference for people: Swagger UI over /openapi.json."""
    return render_template_string(
        PAGE,
        static=lambda name: url_for("docs.static", filename=name),
        spec_url=url_for("ops.openapi_json"),
    )
