"""Exact continuation, the pure part: which earlier call a request continues, and the token ids
that hand the engine exactly what it sampled then, followed by the new messages.

Detection. A request continues call P of its rollout when its messages, after protocol
translation and normalisation, start with P's request messages followed by the assistant message
P returned. Messages are compared in a canonical form (`canonical_message`): text content is the
same whether sent as a string or as text parts, tool-call arguments are compared as parsed JSON,
tool-call ids (made up by the parser, never sampled) are ignored, and reasoning counts as the
harness sends it back: a harness may drop it (P stores a key with and one without it) but not
change it. Request fields that shape the rendered prompt (`CONTEXT_FIELDS`: tools, model,
template settings) are part of every key, so a request with other tools never continues P.

Keys are rolling hashes: a call stores the hash of (context, its request messages, its reply);
a request hashes its messages once, front to back, and its key after each assistant message is a
candidate. The longest stored match is the parent. Storage is a few 16-byte keys per call. The
hashing resumes where an earlier request of the rollout that the request extends left off, so a
request costs a pass over its new messages only (and a memcmp over the rest).

Splice. ids = P's prompt + P's sampled ids + the template's end of an assistant turn (its
end-of-turn token only if P's last sampled token is not already that token, e.g. P stopped at
`max_tokens`) + the rendering of everything after the assistant message. The latter is taken
from two renders with the model's chat template (by the engine, or locally where that gives the
engine's ids, see the renderer modules): `turn` (the messages up to and including the assistant
message, no generation prompt) and `full` (the whole request). It is exact only where the
template preserves prefixes: `full` must start with `turn`, and `turn` must end with the turn
end the template gives any assistant message (`assistant_suffix`, probed once per replica and
request context). Otherwise the call falls back to plain rendering, with the reason recorded.
"""

from __future__ import annotations
