"""The router's HTTP edge: middleware, error and response shapes, endpoint handlers."""
