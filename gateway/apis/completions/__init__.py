"""OpenAI's legacy completions (`POST /v1/completions`): the engine's own API, passed through and recorded."""
