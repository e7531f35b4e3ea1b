"""OpenAI's Responses API (`POST /v1/responses`), served through the engine's chat completions."""
