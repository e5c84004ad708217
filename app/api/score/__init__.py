"""/score: genscore's own scoring API."""
