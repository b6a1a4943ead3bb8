"""Snapshot storage on any fsspec URL: manifests and checksums, the catalog, atomic commits, the writer lease."""
