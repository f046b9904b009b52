"""Network frontends for kiln."""
