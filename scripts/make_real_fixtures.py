"""Reference outputs of transformers on the fetched real models, for tests/test_real_models.py.

    pip install -r scripts/requirements-fixtures.txt
    python scripts/fetch_models.py --model smollm2-135m-instruct --out models/smollm2-135m-instruct
    python scripts/fetch_models.py --model qwen2.5-coder-0.5b-instruct --out models/qwen2.5-coder-0.5b-instruct
    python scripts/make_real_fixtures.py --models models

For every model found under ``--models`` this writes ``tests/fixtures/real/<model>.npz``:
- the float32 logits of transformers on three prompts of different lengths, at every position, for
  a fixed random set of vocabulary ids plus each position's top 8 (the whole vocabulary would be
  megabytes; the tests compare the full rows live when torch is installed);
- the 32 greedy tokens of ``generate`` on three chat prompts;
- the token ids of ``apply_chat_template(messages, tools=...)`` on the three-turn episode of
  ``tests/real_models.py`` (system, tools, user, assistant turns, tool responses), and the messages.
Torch and transformers are needed here only; the tests run without them.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import numpy as np

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

import real_models as R  # noqa: E402


def hf_apply(tokenizer, messages: list[dict], tools, add_generation_prompt: bool) -> list[int]:
    plain = [{k: v for k, v in m.items() if k != "tools"} for m in messages]
    out = tokenizer.apply_chat_template(plain, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", type=pathlib.Path, default=R.MODELS_DIR)
    args = parser.parse_args()
    import torch
    import transformers

    R.FIXTURES.mkdir(parents=True, exist_ok=True)
    for name in R.MODELS:
        directory = args.models / name
        if not (directory / "fetch.json").exists():
            print(f"{name}: not fetched under {args.models}, skipped")
            continue
        tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
        model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
        model.generation_config.eos_token_id = None  # exactly 32 tokens on both sides
        model.generation_config.pad_token_id = 0
        out = {}
        for i, text in enumerate(R.PROMPTS):
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            with torch.no_grad():
                logits = model(torch.tensor([ids])).logits[0].numpy()
            rng = np.random.default_rng(i)
            subset = np.union1d(rng.choice(logits.shape[1], 256, replace=False), np.argsort(-logits, axis=1)[:, :8].ravel())
            out[f"prompt{i}_ids"] = np.asarray(ids, np.int32)
            out[f"prompt{i}_vocab"] = subset.astype(np.int32)
            out[f"prompt{i}_logits"] = logits[:, subset].astype(np.float32)
        env, chat = R.environment(directory)
        tools = R.tool_schemas(env)
        for i, task in enumerate(R.greedy_tasks(env)):
            _, messages = env.reset(task)
            prompt = hf_apply(tokenizer, messages, tools, add_generation_prompt=True)
            with torch.no_grad():
                generated = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                           max_new_tokens=R.GREEDY_TOKENS, do_sample=False)
            out[f"greedy{i}_prompt"] = np.asarray(prompt, np.int32)
            out[f"greedy{i}_tokens"] = generated[0, len(prompt):].numpy().astype(np.int32)
            print(f"{name} greedy {i}: {tokenizer.decode(out[f'greedy{i}_tokens'])!r}")
        run = R.scripted_episode(env, chat)
        out["episode_ids"] = np.asarray(hf_apply(tokenizer, run.messages, tools, add_generation_prompt=False), np.int32)
        record = {"gguf_sha256": json.loads((directory / "fetch.json").read_text())["gguf_sha256"],
                  "transformers": transformers.__version__, "torch": torch.__version__, "messages": run.messages}
        out["record"] = np.frombuffer(json.dumps(record).encode(), np.uint8)
        np.savez_compressed(R.FIXTURES / f"{name}.npz", **out)
        print(f"{name}: wrote {R.FIXTURES / (name + '.npz')}")


if __name__ == "__main__":
    main()
