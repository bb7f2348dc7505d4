"""Harness-facing protocols. Each module translates one wire protocol to and from the
chat-completions requests vLLM serves; see errors.py for the shared error type."""
