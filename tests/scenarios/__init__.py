"""Whole-app scenarios across modules: the app under real servers, a graceful shutdown, a request cancelled or a
client gone at the worst moment."""
