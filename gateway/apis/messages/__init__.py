"""Anthropic's Messages API (`POST /v1/messages`), served through the engine's chat completions."""
