"""genscore HTTP layer: FastAPI app, routes, schemas, errors, settings, batcher and engine."""
