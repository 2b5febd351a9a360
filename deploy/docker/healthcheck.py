#!/usr/bin/env python3
"""Container health check: exit 0 when ``GET URL`` answers 2xx within the timeout, else 1.

Installed in the image as ``deepserve-healthcheck`` so that the Dockerfile, docker-compose.yml and
the process-based compose test run the same check. Standard library only: it must work before
(and without) importing the serving stack, and the slim image has no curl.

    deepserve-healthcheck [URL] [TIMEOUT_S]

URL defaults to ``$DEEPSERVE_HEALTHCHECK_URL``, else the gateway's ``http://127.0.0.1:8000/health``
(the port of ``deepserve up``, the image's default command).
"""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request


def main(argv: list[str]) -> int:
    default = os.environ.get("DEEPSERVE_HEALTHCHECK_URL") or "http://127.0.0.1:8000/health"
    url = argv[1] if len(argv) > 1 else default
    timeout = float(argv[2]) if len(argv) > 2 else 3.0
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return 0 if 200 <= resp.status < 300 else 1
    except (urllib.error.URLError, OSError, ValueError) as exc:  # HTTPError is a URLError
        print(f"unhealthy: {url}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
