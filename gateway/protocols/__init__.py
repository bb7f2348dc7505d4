"""Harness-facing protocols. Each translates one wire protocol to and from the chat-completions
requests vLLM serves, and is served through the one interface the relay knows
(adapter.py: each protocol's `ADAPTER`).

- chat, completions: the engine's own protocols, passed through with their checks.
- anthropic/, responses/: translated, each as types, request translation, its resume cache and
  emission (whole response and stream events).

Shared by them: errors.py (the error type), request_common.py (the request-side helpers: error
texts, tools and tool choice, text content), resumable.py (request bodies decoded from where an
earlier one left off), normalize.py (per-request nonces removed from prompts), segments.py (the
one reader of the engine's output) and segment_stream.py (the stream plumbing on top of it),
openai_common.py (what the OpenAI-style protocols share)."""
