"""OpenAI-compatible `/v1` routes over the same runtime."""
