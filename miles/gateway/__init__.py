"""The gateway: Tinker API (protobuf + JSON), OpenAI endpoints, health and metrics over a `Runtime`."""
