"""Built-in environments (embedded: no download needed)."""
