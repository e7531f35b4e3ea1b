"""A stand-in LLM judge for RULER tests: an OpenAI-compatible /v1/chat/completions on 127.0.0.1 that scores
what it is shown with a Python function, called through litellm as a real judge is (`openai/...` with an
`api_base`). No paid judge API can run on this machine; the stand-in answers from the prompt it gets, so what
a test measures is what RULER sends and does with the answers. A gateway is told of stand-ins as its operator
tells it of judges: `write_judges` makes its --judges-file."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from ruler import Judge

# The judge is shown `<trajectory id="k">` blocks; it answers for ids 1..n.
BLOCK = re.compile(r'<trajectory id="(\d+)">\n(.*?)\n</trajectory>', re.DOTALL)

Answer = Callable[[list[tuple[str, str]], dict[str, Any]], dict[str, Any]]


class StandInJudge:
    """An OpenAI-compatible /v1/chat/completions that scores what it is shown with `answer(blocks, request)`;
    `blocks` are (id, text) in the order shown. Counts its calls and keeps the Authorization header of each."""

    def __init__(self, answer: Answer) -> None:
        self.answer = answer
        self.calls = 0
        self.authorizations: list[str | None] = []
        judge = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                request = json.loads(self.rfile.read(int(self.headers["content-length"])))
                judge.calls += 1
                judge.authorizations.append(self.headers.get("authorization"))
                blocks = BLOCK.findall(request["messages"][-1]["content"])
                content = json.dumps(judge.answer(blocks, request))
                body = json.dumps(
                    {
                        "id": f"stand-in-{judge.calls}",
                        "object": "chat.completion",
                        "created": 0,
                        "model": request["model"],
                        "choices": [
                            {
                                "index": 0,
                                "finish_reason": "stop",
                                "message": {"role": "assistant", "content": content},
                            }
                        ],
                        "usage": {"prompt_tokens": 100, "completion_tokens": 10, "total_tokens": 110},
                    }
                ).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def params(self) -> dict[str, Any]:
        """The litellm parameters that reach it."""
        return {"api_base": f"http://127.0.0.1:{self.server.server_address[1]}/v1", "api_key": "unused"}

    def entry(self, name: str = "stand-in") -> dict[str, Any]:
        """This stand-in as the judge `name` of a gateway's --judges-file (litellm's `openai/<name's last part>`)."""
        return {"model": f"openai/{name.rsplit('/', 1)[-1]}", "litellm_params": self.params}

    def judge(self, name: str = "stand-in") -> Judge:
        return Judge(f"openai/{name}", self.params)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def write_judges(path: Path, judges: Mapping[str, StandInJudge]) -> Path:
    """A --judges-file naming each stand-in (`{name: judge}`) as its operator would."""
    path.write_text(json.dumps({name: judge.entry(name) for name, judge in judges.items()}))
    return path
