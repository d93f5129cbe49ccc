"""Per-example gradient norms and clipped sums."""
