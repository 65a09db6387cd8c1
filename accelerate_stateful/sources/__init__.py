"""Where data comes from when it is not a plain dataset: logical shards and round-robin sources."""
