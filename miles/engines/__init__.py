"""Everything that speaks SGLang's HTTP API: the client, the engine environment, the CPU engine."""
