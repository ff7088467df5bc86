"""SGLang's server information over HTTP, one logic for both of its clients: the capture engine's
server mode (`engines/sglang_capture.py`) and the served evaluation (`evaluation/served.py`).

SGLang 0.5.6 added `GET /server_info` and deprecated `GET /get_server_info` (each call logs a
deprecation warning; 0.5.18 still answers it); 0.5.5 and earlier have only `/get_server_info`
(read in the released `sglang/srt/entrypoints/http_server.py` of 0.5.5, 0.5.6, 0.5.14 and 0.5.18;
tests/test_sglang_releases.py checks 0.5.5, 0.5.14 and 0.5.18). Both return the same JSON: the
server arguments, `version`, and `internal_states`. The current name is asked first; the old one
only when the server answers 404.
"""

from __future__ import annotations

import json
from typing import Any, Callable

from draftflow.errors import DraftflowError

SERVER_INFO_PATHS = ("/server_info", "/get_server_info")  # current (0.5.6+), then the older name

# GET `path` on the server -> (HTTP status, body); raises when the server does not answer at all
Getter = Callable[[str], tuple[int, bytes]]


def server_info(get: Getter, url: str, error: type[DraftflowError] = DraftflowError) -> dict[str, Any]:
    """The server's information from `/server_info`, else (HTTP 404: a release before 0.5.6)
    from `/get_server_info`; `error` for any other answer."""
    for path in SERVER_INFO_PATHS:
        status, raw = get(path)
        if status == 404:
            continue
        if status != 200:
            raise error(f"{url}{path} answered HTTP {status}: {raw[:300].decode('utf-8', 'replace')}")
        try:
            info = json.loads(raw)
        except json.JSONDecodeError:
            info = None
        if not isinstance(info, dict):
            raise error(f"{url}{path} answered with something that is not a JSON object")
        return info
    raise error(
        f"{url} answers neither {' nor '.join(SERVER_INFO_PATHS)} (HTTP 404): not an SGLang server; "
        "check the endpoint's host and port"
    )
