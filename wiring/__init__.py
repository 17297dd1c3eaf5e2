"""The composition root: config -> concrete adapters -> services; the command line."""
