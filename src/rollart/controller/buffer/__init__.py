"""Sample buffer: the staleness-bounded store of trajectories and its version protocol."""
