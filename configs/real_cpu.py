"""A real instruction-tuned model (SmolLM2-135M-Instruct) trained with MTRL on a real collection, on
2 CPU cores, within 8 GiB of memory.

    python -m tools.fetch_models --model smollm2-135m-instruct --out models/smollm2-135m-instruct
    python -m experiments.run --config=configs/real_cpu.py --workdir=workdirs/real_cpu

The checkpoint renders its prompts with its own chat template (``model.chat_template="checkpoint"``;
SmolLM2's ignores tools, so they are described in the system message: ``env.tool_prompt="auto"``).
Short contexts and small groups keep a step to a few minutes. Other models: set
``--config.model.checkpoint=models/qwen2.5-coder-0.5b-instruct``. Memory: the KV cache is
``rollout_max_concurrency`` (at most the step's episodes) x ``rollout.max_len`` tokens.
"""

from configs import default


def get_config():
    c = default.get_config()
    c.unlock()
    c.max_steps = 8
    c.global_batch_size = 4  # queries per step
    c.rollout_max_concurrency = 16  # = global_batch_size x group_size: one generation batch per step
    c.model.checkpoint = "models/smollm2-135m-instruct"
    c.model.chat_template = "checkpoint"
    c.model.scan_unroll = 1  # a loop over the 30 layers: compiles in seconds, not minutes
    c.model.remat = True  # the update keeps one layer's activations at a time
    c.data.synthetic = False
    c.data.folders = "../shared/data/cranfield"
    c.data.validation_min = 50  # held-out queries per collection (all but one of a smaller one)
    c.search.encoder = "tfidf"
    c.search.tfidf_dim = 128
    c.search.top_k = 3
    c.search.max_doc_chars = 200
    c.search.cache_dir = "cache/embeddings"
    c.env.tool_prompt = "auto"
    c.env.max_turns = 4
    c.rollout.group_size = 4
    c.rollout.max_len = 1536
    c.rollout.max_tokens_per_turn = 128
    c.rollout.decode_chunk = 64
    c.rollout.tool_workers = 2
    c.rollout.asynchronous = False  # the two cores go to generation, then to the update
    c.rl.mini_batches = 1
    c.rl.micro_batches = 4
    c.rl.length_bucket = 256
    c.rl.logprob_chunk = 1024  # the 49k-entry vocabulary: logits in chunks of 1,024 tokens
    c.rl.kl_coef = 0.0  # no reference copy of the parameters
    # GRPO's group std (the default's floor under it, grpo:std_floor=0.1,
    # was chosen for the synthetic collection's query types; it is one flag: --config.rl.advantage_options=...)
    c.rl.advantage_options = ""
    c.optim.learning_rate = 1e-6
    c.optim.warmup_steps = 0
    c.warmup.steps = 0  # an instruction-tuned checkpoint: no scripted warm-up
    c.eval.every_steps = 0
    c.checkpoint.every_steps = 4
    c.checkpoint.keep = 2
    c.lock()
    return c
