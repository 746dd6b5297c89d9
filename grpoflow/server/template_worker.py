"""A worker process that renders chat templates sent in requests, run by `templates.py`.

Says `{"ready": true}` once started, then reads one JSON object per line on stdin (`template`, `messages`, `tools`, `max_chars` and the
template's keyword arguments) and answers one per line on stdout: `{"text": ...}` or
`{"error": ..., "limit": "output" | null}`. It imports nothing of grpoflow (it starts in a fraction
of a second) and caps its own address space at `argv[1]` bytes beyond what its imports took, so a
template that builds an enormous string fails here, not in the server.
"""

from __future__ import annotations

import json
import resource
import sys

from transformers.utils.chat_template_utils import render_jinja_template

PAGE_BYTES = resource.getpagesize()


def cap_memory(extra_bytes: int) -> None:
    try:
        with open("/proc/self/statm") as statm:
            used = int(statm.read().split()[0]) * PAGE_BYTES
    except OSError:  # no /proc: the time limit still holds
        return
    resource.setrlimit(resource.RLIMIT_AS, (used + extra_bytes, used + extra_bytes))


def render(request: dict) -> dict:
    max_chars = request.pop("max_chars")
    try:
        (text,), _ = render_jinja_template(conversations=[request.pop("messages")], **request)
    except MemoryError:
        return {"error": "the chat template ran out of memory", "limit": "memory"}
    except Exception as error:  # the template is the client's code: report, keep serving
        return {"error": f"{type(error).__name__}: {error}"[:2000], "limit": None}
    if len(text) > max_chars:
        return {"error": f"the chat template wrote more than {max_chars} characters", "limit": "output"}
    return {"text": text}


def main() -> None:
    cap_memory(int(sys.argv[1]))
    sys.stdout.write(json.dumps({"ready": True}) + "\n")
    sys.stdout.flush()
    for line in sys.stdin:
        answer = render(json.loads(line))
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
