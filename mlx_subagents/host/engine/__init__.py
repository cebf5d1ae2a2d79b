"""The engine room: `EngineHost`, a host over an OpenAI-compatible inference server, its streamed
replies, and token estimates made without a tokenizer."""
