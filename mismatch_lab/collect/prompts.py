"""Prompts: the JSON Lines file, chat-templated token ids, per-sample seeds, and the chunks of work."""

from __future__ import annotations

import json
from pathlib import Path

from mismatch_lab.errors import UserError
from mismatch_lab.runtime import (  # re-exported: their home is mismatch_lab.runtime
    encode_prompts,
    sample_seed,
)

__all__ = ["encode_prompts", "make_chunks", "read_prompts", "sample_seed"]


def read_prompts(path: str) -> list[dict]:
    """Parse a JSON Lines prompt file; every mistake is a UserError naming the line."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"--prompts {path}: no such file; pass a JSON Lines file of {{\"id\", \"prompt\"}} objects")
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"--prompts {path}: unreadable ({exc}); pass a UTF-8 JSON Lines file") from exc
    out, seen = [], set()
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UserError(f"{path}:{n}: not valid JSON ({exc.msg}); each line must be one JSON object") from exc
        if not isinstance(obj, dict) or "id" not in obj or not isinstance(obj.get("prompt"), str) or not obj["prompt"].strip():
            raise UserError(f"{path}:{n}: each line needs an \"id\" and a non-empty string \"prompt\"")
        pid = str(obj["id"])
        if pid in seen:
            raise UserError(f"{path}:{n}: duplicate id {pid!r}; ids must be unique")
        seen.add(pid)
        out.append({"id": pid, "prompt": obj["prompt"], "answer": obj.get("answer")})
    if not out:
        raise UserError(f"--prompts {path}: the file holds no prompts")
    return out


def make_chunks(keep: list[int], prompt_ids: list[list[int]], *, samples: int, max_tokens: int, budget: int,
                chunk_prompts: int = 0) -> list[list[int]]:
    """Prompt indices per committed chunk, in prompt order. A chunk takes prompts while their samples'
    tokens (samples x (prompt + max_tokens)) stay within `budget` (a prompt over the budget alone still makes
    one chunk), or `chunk_prompts` prompts each when that is set."""
    if chunk_prompts:
        return [keep[i:i + chunk_prompts] for i in range(0, len(keep), chunk_prompts)]
    chunks, cur, used = [], [], 0
    for i in keep:
        cost = samples * (len(prompt_ids[i]) + max_tokens)
        if cur and used + cost > budget:
            chunks.append(cur)
            cur, used = [], 0
        cur.append(i)
        used += cost
    return chunks + ([cur] if cur else [])
