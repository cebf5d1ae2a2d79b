"""One agent: its file, its system prompt, and the tool loop that runs it."""
