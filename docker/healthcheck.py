"""The image's HEALTHCHECK: `GET /health` of the server in this container. Exit status 0 when it answers
200 with `"status": "healthy"`, else 1 (docker's "unhealthy"), with one line saying why, which docker
keeps in `docker inspect`'s health log.

The standard library only (the slim image has no curl), and none of the package, so that it starts in
a few tens of milliseconds. The address is the one the server reads from the environment: the port is
`$COSYVOICE_PORT` (the image sets 50000), the host `$COSYVOICE_HOST` (0.0.0.0, every interface, is
reached on loopback). A server moved with `--port` instead is not found: move it with the variable.
"""

from __future__ import annotations

import http.client
import json
import os
import sys
import urllib.request

TIMEOUT = 4.0
"""Seconds: under the HEALTHCHECK's --timeout (5 s), so that a server that hangs is reported here, in one
line, rather than by docker killing the check."""
WILDCARDS = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}
"""Addresses that bind every interface, and the loopback address that reaches them."""


def health_url() -> str:
    """The server's `/health`, from the variables it reads its host and port from."""
    host = os.environ.get("COSYVOICE_HOST", "").strip()
    host = WILDCARDS.get(host, host)
    port = os.environ.get("COSYVOICE_PORT", "").strip() or "50000"
    return f"http://{f'[{host}]' if ':' in host else host}:{port}/health"


def main() -> int:
    """0 when the server is healthy, else 1; one line on stdout either way."""
    url = health_url()
    # no proxy: HTTP_PROXY in the container's environment must not carry a loopback request elsewhere
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=TIMEOUT) as response:
            body = json.load(response)
    except (OSError, http.client.HTTPException, ValueError) as e:  # refused, timed out, 4xx/5xx, not JSON
        print(f"unhealthy: GET {url}: {e}")
        return 1
    status = body.get("status") if isinstance(body, dict) else None
    if status != "healthy":
        print(f"unhealthy: GET {url}: status {status!r}")
        return 1
    print(f"healthy: GET {url}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
