"""The megatron-core training backend's pure parts: model shape, parallel layout, HF <-> megatron weights.

Only `weights.py` and `shards.py` import torch; nothing here imports megatron, so the launcher (layout
validation at submit) and CI (the mapping tests) use these modules without the `gpu` extra.
"""
