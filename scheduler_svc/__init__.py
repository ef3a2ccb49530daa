"""The scheduler service: queues, KV block accounting and the engine loop. CPU only: no torch."""
