"""OpenAI-compatible HTTP server (FastAPI) over :class:`~hisparse.engine.async_engine.AsyncLLM`."""
