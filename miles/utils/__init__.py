"""Small shared utilities (HTTP client factory, in-thread uvicorn servers)."""
