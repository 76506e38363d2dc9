"""Record real raw outputs (greedy, 80 tokens) of Qwen2.5-Coder-0.5B and SmolLM2-135M for
tool prompts built from the recorded agent requests, rendered as the worker renders them
(Qwen: its template with tools; SmolLM2: the generic tool instruction). Writes
tests/fixtures/tool_call_outputs.json (tests/e2e/test_tool_calls_recorded.py reads it).

    LD_PRELOAD=$(python -c "from mlxgw.shared.platform import openblas_path; print(openblas_path())") \
      python -m mlxgw.bench.agents.record_tool_outputs MODELS_DIR   # holding qwen2.5-coder-0.5b and smollm2-135m"""

import argparse
import json
import time
from pathlib import Path

FIXTURES = Path(__file__).resolve().parents[2] / "tests" / "fixtures"


def fn(name, desc, params):
    return {"type": "function", "function": {"name": name, "description": desc, "parameters": params}}


def cases() -> list[tuple[str, list[dict], str]]:
    cc = json.loads((FIXTURES / "claude_code_request.json").read_text())
    cx = json.loads((FIXTURES / "codex_request.json").read_text())
    write = next(t for t in cc["tools"] if t["name"] == "Write")
    bash = next(t for t in cc["tools"] if t["name"] == "Bash")
    exec_cmd = next(t for t in cx["tools"] if t.get("name") == "exec_command")
    return [
        (
            "claude_code_write",
            [fn(write["name"], write["description"], write["input_schema"])],
            "Create hello.py that prints hi.",
        ),
        (
            "claude_code_bash",
            [fn(bash["name"], bash["description"], bash["input_schema"])],
            "List the files in the current folder.",
        ),
        (
            "codex_exec_command",
            [fn(exec_cmd["name"], exec_cmd["description"], exec_cmd["parameters"])],
            "Run `python --version` and tell me the result.",
        ),
    ]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models_dir", type=Path, help="holding qwen2.5-coder-0.5b and smollm2-135m")
    args = ap.parse_args(argv)
    from mlx_lm import generate, load

    from ...worker.text.tool_formats import generic_chat_messages

    out = []
    for model_name, generic in [("qwen2.5-coder-0.5b", False), ("smollm2-135m", True)]:
        model, tok = load(str(args.models_dir / model_name))
        for case, tools, task in cases():
            msgs = [{"role": "user", "content": task}]
            if generic:
                prompt = tok.apply_chat_template(generic_chat_messages(msgs, tools), add_generation_prompt=True)
            else:
                prompt = tok.apply_chat_template(msgs, tools=tools, add_generation_prompt=True)
            t = time.monotonic()
            text = generate(model, tok, prompt, max_tokens=80)
            print(model_name, case, len(prompt), round(time.monotonic() - t, 1), repr(text), flush=True)
            out.append({"model": model_name, "case": case, "task": task, "tools": tools, "output": text})
    (FIXTURES / "tool_call_outputs.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
