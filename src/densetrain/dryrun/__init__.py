"""Dry runs: the real build and step of a job at its real world size, one simulated rank per
process, with PyTorch's fake process group (no peers) and, for the step, fake tensors (shapes,
no storage). What a rank would hold and move is traced, not modelled."""
