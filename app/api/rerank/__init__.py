"""/v1/rerank, /rerank and /v2/rerank: generative reranking."""
