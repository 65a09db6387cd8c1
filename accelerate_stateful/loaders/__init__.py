"""The prepared loaders: the adapter and its lifecycle, one module per variant, and the worker plumbing of streams."""
