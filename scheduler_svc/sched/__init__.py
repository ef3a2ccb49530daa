"""The scheduler core: pure and synchronous (no asyncio, grpc, structlog, clock or threads). Queues, step planning, preemption, sequences, the plan builder."""
