"""A small agentic trace and a scripted three-teacher server for the CLI and end-to-end tests."""

from __future__ import annotations

import json
from pathlib import Path

from support.fake_openai import Reply, Request, text_reply, tool_reply

N_STATES = 12


def write_trace(path: Path, n: int = N_STATES) -> Path:
    """``n`` states: a system prompt, a task, one earlier tool call and its result, then the student's action
    (a wrong tool call on even states, a text answer on odd ones)."""
    lines = []
    for i in range(n):
        messages = [
            {"role": "system", "content": "You are a careful shell agent."},
            {"role": "user", "content": f"Task {i}: find the configuration file of service number {i}."},
            {"role": "assistant", "content": None, "tool_calls": [{
                "id": f"c{i}", "type": "function",
                "function": {"name": "ls", "arguments": json.dumps({"path": "/etc"})}}]},
            {"role": "tool", "tool_call_id": f"c{i}", "content": f"service{i}.conf hosts passwd"},
        ]
        action: object = ({"tool_calls": [{"name": "cat", "arguments": {"path": "/etc/passwd"}}]} if i % 2 == 0
                          else f"I could not find the file for service {i}, sorry.")
        lines.append(json.dumps({"state_id": f"ep1-{i}", "messages": messages, "action": action}))
    path.write_text("\n".join(lines) + "\n")
    return path


def task_of(req: Request) -> int:
    users = [m for m in req.body["messages"] if m["role"] == "user"]
    return int(users[-1]["content"].split(":")[0].split()[-1])


def script(req: Request) -> Reply:
    """Teachers a and b read the right file (same call, arguments in their own order), c agrees on every
    third state only; on state 1 every teacher says what the student said (no pair)."""
    i = task_of(req)
    if i == 1:
        return text_reply("I could not find the file for service 1, sorry.", cost=0.0001)
    if req.model == "c" and i % 3:
        return text_reply(f"Let me think about service {i} some more before acting.", cost=0.0001)
    path = f"/etc/service{i}.conf"
    args = {"path": path, "lines": 50} if req.model != "b" else {"lines": 50, "path": path}
    return tool_reply("read_file", args, content=f"Reading the configuration of service {i} now.", cost=0.0002)


def write_teachers(path: Path, url: str, key_env: str) -> Path:
    tables = "".join(
        f'[[teacher]]\nname = "{m}"\nmodel = "{m}"\nbase_url = "{url}"\napi_key_env = "{key_env}"\n'
        f"usd_per_m_input = 1.0\nusd_per_m_output = 4.0\nmax_tokens = 128\ntimeout_s = 10\n\n" for m in "abc")
    path.write_text(tables)
    return path
