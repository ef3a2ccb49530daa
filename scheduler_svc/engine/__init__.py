"""The engine: the one asyncio loop per worker group that plans, sends, awaits and applies steps, and the request streams back to callers."""
