"""What the launcher (login node) and the runtime (inside the job) agree on, in one pure package.

The resolved preset's schema and checks (`preset/`), the role plan (`roles`), exit codes, the event-log
format (`events`), parallel layout and model shape (`layout`, `shape`), the catalog's model and pool fit
(`catalog`), model-source resolution (`model_source`), engine server-argument flags (`engine_args`),
loss names (`losses`) and port claims (`ports`).

Rules (import-linter contracts in pyproject.toml): this package imports the standard library, pydantic,
PyYAML and (lazily, for hub names) huggingface_hub, and nothing else of ours; the launcher imports
nothing of `miles` but this package.
"""
