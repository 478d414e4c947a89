"""OpenAI-compatible serving: `create_app(engine)` for ASGI, `serve(engine)` to run it with uvicorn,
`ServerConfig` their settings. The app (FastAPI, uvicorn) is imported on first use, so that reading
ServerConfig (the CLI's options) costs nothing."""

from .config import ServerConfig

__all__ = ["ServerConfig", "create_app", "serve"]


def __getattr__(name: str):
    if name in ("create_app", "serve"):
        from . import app

        return getattr(app, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
