"""/v1/completions and /v1/chat/completions: the OpenAI-compatible generation API."""
