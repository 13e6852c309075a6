"""L3 stores shipped with kvtier-core (registered as entry points)."""
