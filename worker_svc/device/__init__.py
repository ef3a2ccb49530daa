"""What the process's devices give the layers: the tensor-parallel group and collectives, CPU features, copies to the host."""
