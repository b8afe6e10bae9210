"""The fault suite (issue 4): the middleware broken on purpose, with real processes and a real PostgreSQL."""
