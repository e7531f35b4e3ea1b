"""Other APIs' wire formats, translated to and from the engine's chat completions."""
