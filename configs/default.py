"""The embedded default: a tiny Qwen3-architecture policy on the synthetic collection, CPU-sized.

    python -m experiments.run --config=configs/default.py --workdir=workdirs/default

It trains its own small tokenizer, warms the policy up on scripted demonstrations of the tool
protocol, then runs MTRL. Everything a real run needs is a field here; see configs/qwen3_search.py.
"""

from ml_collections import config_dict


def get_config():
    c = config_dict.ConfigDict()
    c.seed = 0
    # The three knobs users set.
    c.max_epochs = 1
    c.global_batch_size = 8  # prompts per RL step (each sampled rollout.group_size times)
    c.rollout_max_concurrency = 32  # episodes generated at once (slots of the generation batch)
    # 0: max_epochs * (train tasks // global_batch_size). 48: with 64 the hop spreads to lookups again, with
    # 32 it is not yet learnt on every seed (RL-only runs from the same cold starts, docs/decisions.md)
    c.max_steps = 48
    # JAX's persistent compilation cache: a later run (a rerun, another arm of an ablation, a resumed
    # run) loads the programs an earlier one compiled instead of compiling them again, which is minutes
    # of CPU on the default; "" = off; JAX_COMPILATION_CACHE_DIR, when set, wins
    c.compilation_cache_dir = "~/.cache/mtrl_jax/xla"

    c.model = config_dict.ConfigDict()
    c.model.checkpoint = ""  # a local HF directory; empty: the tiny model below, randomly initialised
    c.model.tokenizer = ""  # tokenizer.json; empty: the checkpoint's, or a BPE trained on the corpus
    c.model.tiny_vocab = 1024
    c.model.tiny_hidden = 128
    c.model.tiny_layers = 2
    c.model.tiny_heads = 4
    c.model.tiny_kv_heads = 2
    c.model.tiny_head_dim = 32
    c.model.tiny_intermediate = 384
    c.model.param_dtype = "float32"  # parameters (as in Flax)
    c.model.dtype = "float32"  # computation: activations and matmuls (as in Flax)
    c.model.remat = False
    # LoRA adapters (0: full fine-tuning); the base model is then frozen and only the adapters train
    c.model.lora_rank = 0
    c.model.lora_alpha = 16.0
    c.model.lora_targets = "q,k,v,o,gate,up,down"
    # training attention: "" = causal einsums in query chunks of attention_chunk positions (fastest on
    # CPU); "xla" or "cudnn" = jax.nn.dot_product_attention with that implementation (cuDNN on GPU)
    c.model.attention_impl = ""
    # each chunk is its own einsums in every compiled program: 256 rather than 128 compiles the update's
    # length branches and the cold start's shapes in less time (docs/decisions.md), for a few more
    # scores computed and masked (the causal triangle's half of each chunk)
    c.model.attention_chunk = 256
    # layers per iteration of the layer loop; 0 = all: no loop, whose backward pass on CPU moves every
    # layer's saved activations through a stacked buffer (~20% slower); deep models keep 1 (compile time)
    c.model.scan_unroll = 0
    c.model.mesh_shape = (1, 1, 1)  # (data, fsdp, tensor); -1 takes the remaining devices
    c.model.assistant_prefix = ""  # e.g. "<think>\n\n</think>\n\n" for Qwen3 without thinking
    c.model.chat_template = ""  # "": hand-written ChatML; "checkpoint": the checkpoint's own jinja template

    c.data = config_dict.ConfigDict()
    c.data.synthetic = True
    c.data.synthetic_seed = 0
    c.data.folders = ""  # comma-separated BEIR folders, e.g. "../shared/data/scifact,../shared/data/cranfield"
    c.data.weights = ""  # comma-separated mixture weights (default: proportional to size)
    # Three splits of each collection by a hash of the query id (mtrl_jax.data.collection.SplitSizes): dev
    # takes max(round(dev_fraction * n), dev_min) tasks, test the next max(round(test_fraction * n), test_min)
    # (at most half of what dev leaves), train the rest. Everything that chooses (evaluations during and after
    # RL, early stopping, rejection sampling, baselines, tools.search_headroom) reads train or dev; test is
    # read only by `python -m experiments.evaluate --split=test --checkpoint=WORKDIR`, which appends to
    # WORKDIR/test_evaluations.jsonl. The synthetic collection's 900 queries: dev 200 (the 45 held out
    # before the test split existed among them), test 200, train 500.
    c.data.dev_fraction = 0.05
    c.data.dev_min = 200
    c.data.test_fraction = 0.05
    c.data.test_min = 200
    c.data.max_eval_tasks = 0  # 0: all dev tasks
    # the first this many of each collection's validation tasks are evaluated (0: all); the split is unchanged
    c.data.max_eval_per_collection = 0
    # the first this many of each collection's training tasks are the cold start's and RL's (0: all); a quick
    # trial of the mechanics (the tests' runs), the held-out split unchanged
    c.data.max_train_per_collection = 0
    # a curriculum of hard queries (0: off): RL trains on the training queries whose best one search (BM25, dense
    # or their fusion, the run's search settings) scores an nDCG@10 below this; the cold start on all of them
    c.data.curriculum_max_baseline = 0.0

    c.search = config_dict.ConfigDict()
    c.search.tools = "bm25_search,vector_search"
    c.search.encoder = "tfidf"  # tfidf | minilm | a sentence-transformers directory
    c.search.tfidf_dim = 32
    c.search.index_type = "flat"
    c.search.top_k = 3
    c.search.max_doc_chars = 60
    # >1: a search call may give a list of up to this many queries, searched each and fused by reciprocal rank
    # fusion (the tool schema says so); 1: one query, a string
    c.search.max_queries = 1
    c.search.cache_dir = ""
    c.search.remote_url = ""  # e.g. http://127.0.0.1:8900 (tools/serve_tools.py)
    c.search.remote_deadline_s = 30.0  # each remote tool call, retries included, ends within this
    c.search.remote_max_failures = 5  # remote calls in a row that fail stop the run, naming the server

    c.env = config_dict.ConfigDict()
    c.env.max_turns = 4
    c.env.answer_fallback = "fusion"
    c.env.max_answer_docs = 10
    # a call identical to one the episode made before: "error" (a tool error saying so) or "run" (run again)
    c.env.repeated_calls = "error"
    c.env.tool_prompt = "compact"  # "schemas" (Qwen's JSON schemas in the system message), "template" (the chat
    # template renders them), "auto" (template if the checkpoint's template renders tools, else schemas)

    c.rollout = config_dict.ConfigDict()
    c.rollout.group_size = 8
    c.rollout.temperature = 1.0
    c.rollout.top_p = 1.0
    c.rollout.max_len = 512  # context tokens per episode
    c.rollout.max_tokens_per_turn = 48
    c.rollout.decode_chunk = 48
    c.rollout.tool_workers = 4  # 0: tools inline (a fully deterministic schedule)
    # compile every extend / decode shape in a background thread while the cold start and the first
    # evaluation run, so that no RL step waits on a shape first met late
    c.rollout.precompile = True
    # a new episode's prompt takes the cached keys and values of the prefix it shares with another
    # episode's (the system prompt, the group's samples of one prompt) instead of computing them again
    c.rollout.share_prefixes = True
    c.rollout.param_dtype = ""  # "bfloat16": the rollouts sample with a bfloat16 copy of the parameters
    c.rollout.asynchronous = True  # generate the next batch while training on this one
    c.rollout.max_staleness = 1  # parameter versions a trained token may lag behind

    c.rl = config_dict.ConfigDict()
    c.rl.loss = "ppo"  # ppo | cispo | is | gspo | any registered loss
    c.rl.advantage = "grpo"  # grpo | dr_grpo | rloo | grpo_passk | reinforce_pp_baseline | registered
    # NAME=VALUE,... passed by name to the loss / the estimator (e.g. "clip_high=0.3", "scale=batch", "k=4");
    # an option the selected function does not take is an error listing the ones it takes; ENTRY:NAME=VALUE
    # applies only while ENTRY is the one selected (so --config.rl.advantage=rloo needs no other change)
    c.rl.loss_options = ""
    # grpo:std_floor=0.1: GRPO divides by max(std_g, 0.1), so a lookup group whose hops gain 0.03 is not scaled
    # up to unit advantages like a multihop group's 0.5 (with the plain group std RL spreads the hop to
    # lookups; with the batch std describe questions stay on BM25: docs/decisions.md)
    c.rl.advantage_options = "grpo:std_floor=0.1"
    c.rl.aggregation = "token-mean"
    c.rl.old_logp = "recompute"
    c.rl.tis_cap = 2.0
    c.rl.kl_coef = (
        0.3  # k3 KL to the policy RL started from (keeps the cold-started copying intact; 0.1 hops on more lookups)
    )
    c.rl.kl_estimator = "k3"
    c.rl.entropy_coef = 0.0
    c.rl.update_epochs = 1
    c.rl.mini_batches = 2
    c.rl.micro_batches = 8  # of 4 rows each, sorted by length: each is computed at its own length
    # a micro-batch is computed at its longest row rounded up to length_bucket: one compiled branch per
    # multiple of it up to rollout.max_len (at most 16), so a smaller bucket trades compile time for padding
    # 10 branches (none below the shortest prompt), ~86% real tokens; 64 (7) pads more, 32 (14) less (docs/decisions.md)
    c.rl.length_bucket = 48
    # with no KL and no entropy term, micro-batches whose rows all have advantage 0 (all-equal groups) add exactly
    # 0 to the gradient: their forward and backward are skipped (computed_rows_frac); False computes them anyway
    c.rl.skip_zero_advantage = True
    c.rl.logprob_chunk = 4096  # tokens per log-prob chunk; a micro-batch within it holds its logits (no recompute)
    # dynamic sampling (DAPO): drop groups whose rewards are all equal (no group-relative signal); with
    # filter_max_extra_groups > 0, first generate up to that many extra groups (random training tasks)
    # to refill the step's global_batch_size informative groups
    c.rl.filter_groups = False
    c.rl.filter_max_extra_groups = 0
    c.rl.truncation = "penalty"  # failed episodes (-1): "penalty" trains on them, "mask" gives their tokens no gradient
    c.rl.max_nonfinite_steps = 3  # RL steps in a row with a non-finite loss/gradient (skipped) before the run stops
    # per-search credit (docs/algorithms.md): "retrieval_gain" gives each search turn a reward, the rise of the
    # nDCG@10 of the documents seen so far minus turn_redundancy x the fraction of its results seen before;
    # normalised per group (floor turn_std_floor), summed over the search turns at and after each turn
    # (discount turn_gamma), and added, times turn_coef, to the trajectory's advantage of every token of that turn
    # "one_search": each query's best one-search nDCG@10 (BM25, dense, fusion) subtracted from its rewards in the
    # update (s3's gain over a fixed retrieval); a per-query constant, so a no-op under every group-relative
    # estimator but grpo:scale=batch (docs/algorithms.md)
    c.rl.reward_baseline = "none"
    c.rl.turn_reward = "none"
    c.rl.turn_coef = 1.0
    c.rl.turn_gamma = 1.0
    c.rl.turn_redundancy = 0.5
    c.rl.turn_std_floor = 0.1

    c.optim = config_dict.ConfigDict()
    c.optim.learning_rate = 3e-4
    c.optim.schedule = "constant"
    c.optim.warmup_steps = 8  # optimiser steps (2 per RL step): no sign-like full-size Adam steps at the start
    c.optim.grad_clip = 1.0
    c.optim.weight_decay = 0.0

    # The cold start (the supervised stage before RL; its keys keep the name warmup.*): 0 steps runs RL from the
    # initial policy as it is, which no model here survives (configs/real_cpu.py gives fetched checkpoints one too).
    c.warmup = config_dict.ConfigDict()
    # The tiny policy must learn to copy an identifier out of
    # search results for RL to learn the hop: after 2,400 steps one seed of three had (docs/decisions.md), after
    # 3,000 all
    c.warmup.steps = 3000
    c.warmup.batch_size = 16
    c.warmup.learning_rate = 3e-3
    # compute the tokens every demonstration opens with (system prompt) once per step, not in every row:
    # the same losses and gradients, about 1.5x faster steps (docs/decisions.md)
    c.warmup.share_prefix = True
    # the steps' views of the demonstrations: one in full_every trains on whole ones, one in two_turn_every
    # (0: none) on them cut after their second turn (the hop's copy; most of the cold start's time, since
    # they hold the first search's results), the rest on them cut after their first turn (the question's copy)
    c.warmup.full_every = 8
    c.warmup.two_turn_every = 2
    c.warmup.augment = 3  # extra demonstrations per question, rewritten (identifiers randomised, words swapped)
    # extra demonstrations per question with one word edited: in double quotes, a backslash in it, or a letter
    # accented, so that copying a question into a call's JSON is shown escaped (quotes, backslashes) or as is
    c.warmup.special_copies = 0
    # TOOL:WEIGHT,... the scripted teacher's first tool, whatever the question ("": uniform)
    c.warmup.teacher_tools = ""
    # K:WEIGHT,... the number of results it asks for, whatever the question ("": no top_k argument)
    c.warmup.teacher_top_k = "1:3,2:1,3:1,5:1"
    # probability of a second search on an identifier copied from the first's results (one drawn at
    # random among those shown), whatever the question: RL learns which questions the hop pays on
    c.warmup.teacher_hop = 0.5
    # TOOL:WEIGHT,... the second search's tool ("": uniform; "other": a tool the first search did not use)
    c.warmup.teacher_hop_tools = "bm25_search:1"
    # extra demonstrations per question whose teacher always hops, with no loss on the token that decides
    # to hop (the second turn's first): more of the copy to learn, the same learnt probability of hopping
    c.warmup.hop_drills = 2
    # NAME:WEIGHT,... what the second search looks for: "identifier" (a word with a digit shown in the results),
    # "title" (a result's title: an entity to follow), "keywords" (the question's content words), "question" (the
    # question itself: with teacher_hop_tools="other", both tools' rankings of it, fused by env.answer_fallback)
    c.warmup.teacher_hop_queries = "identifier:1"
    # NAME:WEIGHT,... how the teacher answers: "empty" (the environment's answer_fallback ranks the results) or
    # "ids" (the ids the searches showed, in order)
    c.warmup.teacher_answers = "empty:1"
    # probability that a demonstration's searches give lists of queries (the question and its content words; the
    # hop's candidates): needs search.max_queries >= 2
    c.warmup.teacher_multi_query = 0.0
    # rejection sampling: draw this many demonstrations per training task and keep those whose reward (on the
    # training task's own judgments) is at least min_reward (-1: keep all)
    c.warmup.samples_per_task = 1
    c.warmup.min_reward = -1.0
    # best of samples_per_task: of a judged task's draws, keep only the one with the highest reward (ties: the one
    # whose answer has fewest tokens, then the first drawn)
    c.warmup.keep_best = False
    # with keep_best: keep the best draw of each number of searches a task's draws made (one search, two, ...), not
    # the best of all, so the cold start still shows the moves that best-of-n drops for RL to weigh
    c.warmup.keep_best_per_searches = False
    # the output projection at the trained columns only: the same loss to float rounding, less work where tool
    # results are most of a demonstration (real models); off on the default, whose learning depends on rounding
    c.warmup.loss_columns_only = False
    c.warmup.micro_batches = 1  # a step's rows in slices, gradients accumulated: less memory (needs loss_columns_only)
    # with LoRA (model.lora_rank > 0): the cold start trains every base weight (a policy trained from scratch, like
    # the tiny default, cannot learn the protocol through adapters over a random base); RL then trains fresh
    # adapters over the cold-started base, which is frozen (and is the KL reference with the adapters off)
    c.warmup.train_base = False

    c.eval = config_dict.ConfigDict()
    c.eval.every_steps = 0  # 0: only before and after RL
    c.eval.temperature = 0.0  # greedy
    c.eval.before_warmup = False  # also evaluate the base policy before the cold start (summary.json's "base")

    c.checkpoint = config_dict.ConfigDict()
    c.checkpoint.every_steps = 4
    c.checkpoint.keep = 2

    c.log = config_dict.ConfigDict()
    c.log.trajectories = True
    c.log.progress = True
    c.lock()
    return c
