"""The HTTP server: OpenAI-compatible API, document API, metrics, health, auth (aiohttp)."""
