"""Qwen2.5-Coder-0.5B-Instruct taught to search on the four shared collections, on 2 CPU cores: the recipe
of configs/real_cpu.py (a cold start on scripted demonstrations, then MTRL, evaluations before each and
after RL) on a model about 4x the cost per token of SmolLM2-135M, so on a much shorter schedule.

    python -m tools.fetch_models --model qwen2.5-coder-0.5b-instruct --out models/qwen2.5-coder-0.5b-instruct
    python -m benchmarks.bench_real_learning --config=configs/real_cpu_qwen.py --seeds 0

Qwen2.5's chat template renders the tools itself (its system prompt and ``<tool_call>`` format, which
is this project's protocol), so ``env.tool_prompt="auto"`` lets it: the demonstrations are the model's own
format, token for token (tests/test_real_models.py).
"""

from configs import real_cpu


def get_config():
    c = real_cpu.get_config()
    c.unlock()
    c.model.checkpoint = "models/qwen2.5-coder-0.5b-instruct"
    c.model.scan_unroll = 1
    c.env.tool_prompt = "auto"  # the checkpoint's template renders the tool schemas
    c.rollout.max_len = 1536  # its tool system prompt is about 400 tokens longer than the compact one
    c.rl.logprob_chunk = 512  # a 151,936-entry vocabulary: logits in chunks of 512 tokens
    # a shorter schedule: 16 cold start steps (128 of the best-of-4 demonstrations, as for SmolLM2), 3 RL steps, and
    # each evaluation on the first 8 held-out queries of each collection (the split unchanged; the bench's
    # baselines are on the same 32 queries)
    c.warmup.steps = 16
    c.max_steps = 3  # RL steps
    c.data.max_eval_per_collection = 8
    c.lock()
    return c
