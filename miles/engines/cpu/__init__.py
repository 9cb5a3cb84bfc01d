"""An SGLang-compatible engine on CPU (CUDA when present): same HTTP API, shapes and errors as SGLang 0.5.23.

    python -m miles.engines.cpu --model-path DIR --port P [--host H] [--legacy-weight-api] [--api-key K]

Used on CPU nodes, in demos and in tests; see docs/engines.md for what is and is not supported.
"""
