"""Request engines: many concurrent generation requests over one loaded artifact (the server's core)."""
