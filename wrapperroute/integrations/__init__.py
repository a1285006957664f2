"""Integrations with training libraries. Each is imported explicitly (``wrapperroute.integrations.trl``), so
importing ``wrapperroute`` never imports the library it integrates with."""
