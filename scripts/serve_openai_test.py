#!/usr/bin/env python3
"""Serve a local target over a small OpenAI-compatible API on 127.0.0.1, with optional faults.

For trying `regenerate` with engine 'openai' without a GPU server, and for watching how the
client copes with failures:

    python scripts/serve_openai_test.py --build-target /tmp/tiny-target --port 8011 \\
        --faults 429:1,500,delay:5,drop --api-key-env MY_TEST_KEY
    # config: regenerate: {engine: openai, openai: {endpoints: [http://127.0.0.1:8011/v1],
    #                      model: draftflow-tiny, api_key_env: MY_TEST_KEY, timeout_s: 3}}

Faults apply to chat requests in arrival order (then every request succeeds): `429[:s]`
(rate limited, Retry-After s), `500`, `503`, `delay:s` (answer after s seconds, past a
shorter client timeout), `drop` (close the connection halfway through the body), `ok`.
The server stops by itself after --lifetime-s seconds or --max-requests requests.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from draftflow.engines.servers import FaultPlan, OpenAITestServer, TargetChatBackend, ensure_tiny_target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--target", type=Path, help="a local Hugging Face model folder (small: it runs on the CPU)")
    source.add_argument("--build-target", type=Path, metavar="DIR", help="build a tiny builtin target here first (if absent)")
    parser.add_argument("--model-name", default="draftflow-tiny", help="the id /v1/models reports")
    parser.add_argument("--port", type=int, default=0, help="0: any free port (printed)")
    parser.add_argument("--faults", default="", help="comma-separated, e.g. 429:1,500,delay:5,drop")
    parser.add_argument("--api-key-env", default=None, help="require the key held by this environment variable")
    parser.add_argument("--reasoning", action="store_true", help="add reasoning_content unless thinking is disabled")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--lifetime-s", type=float, default=3600.0)
    parser.add_argument("--max-requests", type=int, default=100_000)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    api_key = None
    if args.api_key_env:
        api_key = os.environ.get(args.api_key_env)
        if not api_key:
            parser.error(f"--api-key-env {args.api_key_env}: that environment variable is not set")
    target = ensure_tiny_target(args.build_target) if args.build_target else args.target
    server = OpenAITestServer(
        backend=TargetChatBackend(target, device=args.device, reasoning=args.reasoning),
        model_name=args.model_name,
        faults=FaultPlan([f for f in args.faults.split(",") if f.strip()]),
        api_key=api_key,
        port=args.port,
        lifetime_s=args.lifetime_s,
        max_requests=args.max_requests,
    )
    print(f"serving {target} as {args.model_name!r} at {server.base_url}", flush=True)
    try:
        server.serve()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
