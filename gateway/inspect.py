"""`rolltap inspect`: the trace viewer's information in a terminal, from the same JSON routes
(/ui/api/...) with the admin key.

Recorded text comes from agents that may be hostile: control characters (terminal escape
sequences among them) are shown as visible escapes, never written raw to the terminal."""

from __future__ import annotations

import json
import os
import re
import sys

_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
TRAINED = "\x1b[42;30m"  # trained tokens: black on green
RESET = "\x1b[0m"


def safe(text) -> str:
    """Text with every control character but newline and tab escaped (`\\x1b`)."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", str(text))


def _cell(value, width: int) -> str:
    text = "-" if value is None else safe(value).replace("\n", " ")
    return text[: width - 1] + "…" if len(text) > width else text.ljust(width)


LIST_HEADER = (
    f"{'rollout':36}  {'task':16}  {'group':12}  {'harness':12}  {'status':8}  {'reward':>7}  "
    f"{'calls':>5}  {'seqs':>4}  {'trained':>7}  created"
)


def list_line(r: dict) -> str:
    reward = "-" if r["reward"] is None else f"{r['reward']:.3f}"
    seqs = "-" if r["sequences"] is None else r["sequences"]
    trained = "-" if r["trained_tokens"] is None else r["trained_tokens"]
    return (
        f"{r['rollout_id']:36}  {_cell(r['task_id'], 16)}  {_cell(r['group_id'], 12)}  "
        f"{_cell(r['harness'], 12)}  {r['status']:8}  {reward:>7}  {r['calls']:>5}  "
        f"{seqs:>4}  {trained:>7}  {r['created_at'][:19].replace('T', ' ')}"
    )


def _text(content) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "\n".join(p.get("text", json.dumps(p)) if isinstance(p, dict) else str(p)
                     for p in content)


def _conversation(call: dict) -> list[str]:
    req = call.get("request") or {}
    out = []
    for key in ("system", "instructions"):
        if req.get(key):
            out.append(f"[{key}] {_text(req[key])}")
    items = req.get("messages") or req.get("input") or []
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    for m in items:
        text = _text(m.get("content")) if "content" in m else json.dumps(m)
        if m.get("tool_calls"):
            text += " " + json.dumps(m["tool_calls"])
        out.append(f"[{m.get('role') or m.get('type')}] {text}")
    reply = (call.get("response") or {}).get("message")
    if reply:
        text = _text(reply.get("content"))
        if reply.get("tool_calls"):
            text += " " + json.dumps(reply["tool_calls"])
        out.append(f"[reply, {call.get('finish_reason')}] {text}")
    return [safe(line) for line in out]


def format_show(data: dict, tokens: bool = False, colour: bool = True) -> str:
    r = data["rollout"]
    lines = [
        f"rollout {r['rollout_id']}",
        f"  task {safe(r['task_id'])}  group {safe(r['group_id'])}  harness {safe(r['harness'])}",
        f"  status {r['status']}  reward {r['reward']}  created {r['created_at']}  "
        f"finished {r['finished_at']}",
        "verifier output:",
        *(f"  {safe(k)}: {safe(json.dumps(v) if not isinstance(v, str) else v)}"
          for k, v in (r["metrics"] or {}).items()),
        f"merge: {json.dumps(r['merge_stats'])}" if r["merge_stats"] else "merge: not merged",
        *([f"trainer: {json.dumps(r['ledger'])}"] if r.get("ledger") else []),
        *([safe(r["trained_nothing"])] if r.get("trained_nothing") else []),
        "calls:",
        f"  {'seq':>3}  {'status':7}  {'latency':>8}  {'ttft':>7}  {'prompt':>6}  "
        f"{'sampled':>7}  {'continuation':24}  {'replica':24}  finish",
    ]
    for c in data["calls"]:
        cont = c.get("continuation") or {}
        path = ": ".join(str(x) for x in (cont.get("path"), cont.get("reason")) if x) or "-"
        latency = f"{c['latency_ms']:.0f}ms" if c["latency_ms"] is not None else "-"
        ttft = f"{c['ttft_ms']:.0f}ms" if c["ttft_ms"] is not None else "-"
        lines.append(
            f"  {c['seq']:>3}  {c['status']:7}  {latency:>8}  {ttft:>7}  {c['prompt_tokens']:>6}  "
            f"{c['completion_tokens']:>7}  {_cell(path, 24)}  {_cell(c['upstream'], 24)}  "
            f"{c['finish_reason'] or '-'}"
        )
    lines.append("sequences:")
    for k, s in enumerate(data["sequences"]):
        versions = sorted({v for v, m in zip(s["versions"], s["loss_mask"]) if m})
        calls = ", ".join(str(b["seq"]) for b in s["boundaries"])
        flags = "".join(f" {f}" for f in ("auxiliary", "excluded") if s[f])
        lines.append(
            f"  {k}: {len(s['input_ids'])} tokens, {sum(s['loss_mask'])} trained, fork cause "
            f"{s['cause']}, policy versions {versions}, calls {calls}{flags}"
        )
        if tokens:
            lines.append("    " + _tokens(s, data.get("token_text"), colour))
    if data.get("tokenizer_note") and tokens:
        lines.append(f"  ({data['tokenizer_note']})")
    if data["calls"]:
        lines.append(f"conversation of call {data['calls'][-1]['seq']}:")
        lines += [f"  {line}" for line in _conversation(data["calls"][-1])]
    return "\n".join(lines)


def _tokens(seq: dict, texts: dict | None, colour: bool) -> str:
    """The sequence's text, trained tokens highlighted (or in ⟦ ⟧ without colour)."""
    out, trained = [], False
    for i, m in zip(seq["input_ids"], seq["loss_mask"]):
        text = safe(texts.get(str(i), f"⟨{i}⟩")) if texts else f"⟨{i}⟩"
        if bool(m) != trained:
            out.append((TRAINED if m else RESET) if colour else ("⟦" if m else "⟧"))
            trained = bool(m)
        out.append(text)
    if trained:
        out.append(RESET if colour else "⟧")
    return "".join(out)


def _client(args):
    import httpx

    if not args.admin_key:
        raise SystemExit("rolltap inspect: no admin key; set ROLLTAP_ADMIN_KEY or pass "
                         "--admin-key")
    return httpx.Client(base_url=args.gateway.rstrip("/"), timeout=60,
                        headers={"Authorization": f"Bearer {args.admin_key}"})


def _get(client, path: str, params=None) -> dict:
    import httpx

    try:
        resp = client.get(path, params=params)
    except httpx.HTTPError as exc:
        raise SystemExit(f"rolltap inspect: cannot reach the gateway at {client.base_url}: "
                         f"{exc}. Check --gateway.") from None
    if resp.status_code != 200:
        try:
            message = resp.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = resp.text[:200]
        raise SystemExit(f"rolltap inspect: {resp.status_code}: {message}")
    return resp.json()


def _list(args) -> int:
    params = {k: v for k, v in (("task", args.task), ("group", args.group),
                                ("status", args.status), ("harness", args.harness),
                                ("min_reward", args.min_reward), ("max_reward", args.max_reward),
                                ("limit", args.limit)) if v is not None}
    shown, after = 0, None
    with _client(args) as client:
        while True:
            page = _get(client, "/ui/api/rollouts", {**params, **({"after": after} if after
                                                                  else {})})
            if not shown:
                print(LIST_HEADER)
            for row in page["rollouts"]:
                print(list_line(row))
            shown += len(page["rollouts"])
            after = page["next"]
            if after is None or not args.all:
                break
    if after is not None:
        print(f"({shown} shown; more with --all or narrower filters)")
    return 0


def _show(args) -> int:
    with _client(args) as client:
        data = _get(client, f"/ui/api/rollouts/{args.rollout_id}")
    colour = args.colour == "always" or (args.colour == "auto" and sys.stdout.isatty())
    print(format_show(data, tokens=args.tokens, colour=colour))
    return 0


def register(subparsers) -> None:
    env = os.environ.get
    parser = subparsers.add_parser(
        "inspect",
        help="list and show recorded rollouts in the terminal (what the /ui viewer shows)",
        description="Read the gateway's recorded rollouts with the admin key: `list` pages "
        "through them with filters, `show ID` prints one rollout's verifier output, calls, "
        "merged sequences and conversation.",
    )
    parser.add_argument("--gateway", default=env("ROLLTAP_GATEWAY", "http://127.0.0.1:9000"),
                        metavar="URL", help="gateway URL (env ROLLTAP_GATEWAY; default "
                        "%(default)s)")
    parser.add_argument("--admin-key", default=env("ROLLTAP_ADMIN_KEY"), metavar="KEY",
                        help="the gateway's admin key (env ROLLTAP_ADMIN_KEY)")
    sub = parser.add_subparsers(dest="inspect_command", metavar="list|show", required=True)
    ls = sub.add_parser("list", help="rollouts, newest first")
    for name in ("task", "group", "harness"):
        ls.add_argument(f"--{name}", default=None, help=f"only this {name}")
    ls.add_argument("--status", choices=("running", "finished", "failed", "timeout", "aborted"))
    ls.add_argument("--min-reward", type=float, default=None, metavar="R")
    ls.add_argument("--max-reward", type=float, default=None, metavar="R")
    ls.add_argument("--limit", type=int, default=50, help="rows per page (1-200; default 50)")
    ls.add_argument("--all", action="store_true", help="every page, not only the first")
    ls.set_defaults(func=_list)
    show = sub.add_parser("show", help="one rollout")
    show.add_argument("rollout_id", metavar="ROLLOUT_ID")
    show.add_argument("--tokens", action="store_true",
                      help="also print each sequence's text with trained tokens highlighted "
                      "(token text needs the gateway's --tokenizer)")
    show.add_argument("--colour", choices=("auto", "always", "never"), default="auto",
                      help="highlight trained tokens with colour (default: on a terminal)")
    show.set_defaults(func=_show)
