"""The HTTP API: one folder per endpoint family (protocol, serving, router); wire formats live here."""
