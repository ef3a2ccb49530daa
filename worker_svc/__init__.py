"""The worker service: model weights and KV-cache tensors, one model step per plan."""
