"""Database models, engine and migrations helpers."""
