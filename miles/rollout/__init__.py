"""Engines on Ray: engine cells, the InferenceController (routing, update bracket), health checks."""
