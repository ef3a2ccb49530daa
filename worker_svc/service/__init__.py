"""The worker process: gRPC server and servicer, registration, and the main-thread executor that runs every step."""
