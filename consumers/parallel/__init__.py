"""Data parallelism: the torch.distributed group of a consumer job, fixed or elastic (torchft)."""
