"""OpenAI-compatible serving: `create_app(engine)` for ASGI, `serve(engine)` to run it with uvicorn."""

from .app import create_app, serve

__all__ = ["create_app", "serve"]
