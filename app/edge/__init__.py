"""The ASGI stack around the API, knowing no engine: limits, auth, request ids, access log, metrics."""
