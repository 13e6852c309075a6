"""Host allocators shipped with kvtier-core (registered as entry points)."""
