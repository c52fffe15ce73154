"""Moving tensors between ranks: MPI collectives on torch tensors (by kind), prepared and
non-blocking collectives, buffers and their pool, byte accounting, debug-mode agreement
on arguments, and the custom ops torch.compile traces."""
