"""Transfer engines shipped with kvtier-core (registered as entry points)."""
