class PlacementError(ValueError):
    """Raised for bad input to `inspect_model` / `convert`, and by `convert(strict=True)` for a skipped block."""
