"""The engine supervisor: starts the vLLM engines the gateway serves through (one per base model, each on its own
port), watches them, restarts one that dies and stops them with the gateway (`supervisor.py`). No HTTP of the
gateway's own: it only calls an engine's health and LoRA endpoints."""
