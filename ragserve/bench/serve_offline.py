"""The offline side of ``ragserve bench serve``'s overhead measurement, as a subprocess.

``python -m ragserve.bench.serve_offline DOC_FILE QUESTION [engine flags]`` builds the
engine, turns the document and question into exactly the token ids the server builds for
a chat with that document, runs the prompt once (so it is cached), prints
``{"ready": true, "prompt_tokens": N}`` and then, for every line ``run`` on stdin, times
one ``LLM.generate`` of that prompt with ``max_tokens=1`` and prints
``{"seconds": S, "prompt_tokens": N, "cached_tokens": C}``. It exits at end of input.

NOTE: it is a process of its own, started with the server's environment, so both sides
of the ratio run with the same torch thread settings, and neither process's idle OpenMP
workers sit in the other's address space. As in the server, the engine is built on the
main thread and steps on another thread (torch's intra-op threads behave differently on
the thread that first ran a parallel op).
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def main(argv: Sequence[str] | None = None) -> int:
    from ragserve import LLM, SamplingParams
    from ragserve.bench.common import succeeded
    from ragserve.cli import add_engine_args, engine_config_from_args
    from ragserve.server.prompts import PromptBuilder

    parser = argparse.ArgumentParser(prog="python -m ragserve.bench.serve_offline")
    parser.add_argument("doc_file")
    parser.add_argument("question")
    add_engine_args(parser)
    args = parser.parse_args(argv)
    config = engine_config_from_args(args)
    llm = LLM.from_config(config)
    builder = PromptBuilder(llm.get_tokenizer())
    text = Path(args.doc_file).read_text(encoding="utf-8")
    ids = builder.chat_ids(
        [{"role": "user", "content": args.question}], [builder.document_ids(text)]
    )
    builder.close()
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)

    def serve_commands() -> None:
        succeeded(llm.generate([ids], params, use_tqdm=False))
        _reply({"ready": True, "prompt_tokens": len(ids)})
        for line in sys.stdin:
            if line.strip() != "run":
                _reply({"error": f"unknown command {line.strip()[:40]!r}"})
                continue
            started = time.perf_counter()
            output = succeeded(llm.generate([ids], params, use_tqdm=False))[0]
            seconds = time.perf_counter() - started
            _reply(
                {
                    "seconds": seconds,
                    "prompt_tokens": len(output.prompt_token_ids),
                    "cached_tokens": output.num_cached_tokens,
                }
            )

    worker = threading.Thread(target=serve_commands, name="ragserve-bench-offline")
    worker.start()
    worker.join()
    llm.close()
    return 0


def _reply(payload: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(payload) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    raise SystemExit(main())
