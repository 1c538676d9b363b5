"""Entry point of an API server process (``hybridlb:api:<node>``)."""

from __future__ import annotations

import uvicorn

from hybridlb import lifecycle
from hybridlb.api.app import create_app
from hybridlb.config import Config


def run_api_server(config: Config, engines: list[tuple[int, str]], node: int = 0) -> None:
    """Serve HTTP on ``config.api.host:port`` over ``engines`` until SIGTERM."""
    title = f"hybridlb:api:{node}"
    lifecycle.set_title(title)
    lifecycle.configure_logging(title)
    lifecycle.die_with_parent()
    app = create_app(config, engines, node)
    server = uvicorn.Server(uvicorn.Config(
        app, host=config.api.host, port=config.api.port, log_level=config.api.log_level,
        access_log=False, loop="uvloop", http="httptools", timeout_graceful_shutdown=3,
    ))
    server.run()
