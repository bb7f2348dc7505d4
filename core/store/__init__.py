"""Postgres storage: connection (server or embedded), migrations, and the queries of each table."""
