"""Pure arithmetic: an epoch's order from (seed, epoch) and each rank's share of it."""
