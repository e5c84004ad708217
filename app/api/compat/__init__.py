"""Drop-in scoring routes of other servers: SGLang's /v1/score and vLLM's /generative_scoring."""
