"""OpenAI's chat completions (`POST /v1/chat/completions`): the engine's own API, passed through and recorded."""
