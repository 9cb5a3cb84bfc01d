"""Tinker wire protocol: protobuf codec and the `/api/v1` routes."""
