"""gRPC helpers both services use: the error interceptor, server metrics, TLS credentials, exclusive ports."""
