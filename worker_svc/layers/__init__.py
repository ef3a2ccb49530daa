"""Model layers: replicated and tensor-parallel linears, rotary, mixture of experts, the attention backends."""
