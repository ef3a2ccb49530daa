"""LoRA on the worker: adapters read into host memory and the device slots the plans fill."""
