"""The scheduler's side of the worker link: one client per rank, a tensor-parallel group's ranks in lockstep, the registrations."""
