"""LoRA on the scheduler: which adapters may be named, and which sits in which worker slot."""
