"""OpenAI-compatible HTTP server: app factory, schemas, worker queue, metrics, errors."""
