"""The megatron-core training backend's parts (the backend itself: miles.train.backends.megatron_backend).

Pure, importable without the `gpu` extra (the launcher checks layouts at submit with them; CI tests them):
shape.py and layout.py (no torch), weights.py, shards.py and memory.py. megatron-core is imported at the top
of model.py, attention.py, norm.py, compute.py and optim_state.py, which only a starting backend imports.
"""
