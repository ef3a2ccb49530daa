"""KV-cache accounting: block pools with reference counts and prefix hashes, the block manager's device and host pools, cache events. Pure and synchronous."""
