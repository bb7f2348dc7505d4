"""Harness-facing protocols. Each protocol module translates one wire protocol to and from the
chat-completions requests vLLM serves. Shared by them: errors.py (the error type and the request
errors' texts), tools.py (tools and tool choice on the request side), segments.py (the one reader
of the engine's output, which the translating protocols render streamed and whole replies from;
chat and completions pass the engine's own output through)."""
