"""Built-in tasks: small, deterministic, downloaded from nowhere."""
