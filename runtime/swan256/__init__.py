"""swan256: the 256-token-page DSV4 sparse decode module (see README.md)."""
