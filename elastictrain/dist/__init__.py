"""The process group and everything sent over it: collectives, metric reduction, the vote's rounds, DDP/FSDP wrapping, gradient sync, peer failures."""
