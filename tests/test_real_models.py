"""Real instruction-tuned checkpoints (tools/fetch_models.py) against transformers: logits, greedy
decoding with the project's sampler, the chat template of a three-turn episode, export and reload.

Each test skips when its model has not been fetched (``models/<name>``, or ``MTRL_MODELS_DIR``).
The transformers side comes from ``tests/fixtures/real/<name>.npz`` (tools/make_real_fixtures.py);
with torch and transformers installed, the logits and the chat rendering are also compared live."""

import json
import re

import jax
import numpy as np
import pytest

import tools.make_real_fixtures as R
from envs import background, background_result, popen
from mtrl_jax.chat_template import TemplateChat
from mtrl_jax.model import compute_logits, load_hf_checkpoint, save_hf_checkpoint
from mtrl_jax.rollout.engine import Sampler

LOGIT_TOL = 2e-4


@pytest.fixture(scope="module", params=R.MODELS)
def real(request):
    name = request.param
    directory = R.MODELS_DIR / name
    if not (directory / "fetch.json").exists():
        pytest.skip(f"{name} not fetched: python -m tools.fetch_models --model {name} --out {directory}")
    fixture = np.load(R.FIXTURES / f"{name}.npz")
    record = json.loads(bytes(fixture["record"]).decode())
    assert json.loads((directory / "fetch.json").read_text())["gguf_sha256"] == record["gguf_sha256"]
    model, params = load_hf_checkpoint(directory)
    return name, directory, fixture, record, model, params


def _transformers():
    try:
        import torch
        import transformers
    except ImportError:
        return None, None
    return torch, transformers


@pytest.mark.slow
def test_logits_match_transformers(real):
    name, directory, fixture, _, model, params = real
    torch, transformers = _transformers()
    hf = (
        None
        if torch is None
        else transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    )
    for i in range(len(R.PROMPTS)):
        ids = fixture[f"prompt{i}_ids"]
        ours = np.asarray(compute_logits(model, params, ids[None]))[0]
        vocab = fixture[f"prompt{i}_vocab"]
        assert len(ids) > 0 and ours.shape == (len(ids), model.config.vocab_size)
        np.testing.assert_allclose(ours[:, vocab], fixture[f"prompt{i}_logits"], atol=LOGIT_TOL, rtol=0)
        if hf is not None:  # every vocabulary entry, live
            with torch.no_grad():
                full = hf(torch.tensor(ids[None].astype(np.int64))).logits[0].numpy()
            np.testing.assert_allclose(ours, full, atol=LOGIT_TOL, rtol=0)
    assert len({len(fixture[f"prompt{i}_ids"]) for i in range(len(R.PROMPTS))}) == len(R.PROMPTS)  # several lengths


@pytest.mark.slow
def test_greedy_decoding_matches_transformers_generate(real):
    name, _, fixture, _, model, params = real
    prompts = [fixture[f"greedy{i}_prompt"] for i in range(3)]
    new = R.GREEDY_TOKENS
    smp = Sampler(model.config, slots=len(prompts), max_len=max(map(len, prompts)) + new, max_new_tokens=new)
    state, _ = smp.extend(params, smp.init(), [list(p) for p in prompts])
    B = len(prompts)
    out = smp.decode(
        params,
        state,
        jax.random.split(jax.random.PRNGKey(0), B),
        np.zeros(B, np.float32),
        np.ones(B, np.float32),
        np.full((B, 1), -1, np.int32),
        np.ones(B, bool),
        np.full(B, new, np.int32),
    )[1]
    tokens = np.asarray(out.tokens)
    for i in range(B):
        np.testing.assert_array_equal(tokens[i, :new], fixture[f"greedy{i}_tokens"], err_msg=f"{name} prompt {i}")


def test_the_episode_driver_renders_the_checkpoints_own_chat_template(real):
    """The fixture's episode (system with the tools as the template wants them, user, three assistant
    turns and the tool responses) replayed through the episode driver: token for token
    ``apply_chat_template(messages, tools=...)``. The messages come from the fixture, so the test depends
    on no collection's text."""
    name, directory, fixture, record, _, _ = real
    chat = TemplateChat.from_checkpoint(directory)
    messages = record["messages"]
    run = R.replay_episode(chat, messages)
    assert run.messages == messages
    assert [m["role"] for m in run.messages] == [
        "system",
        "user",
        "assistant",
        "tool",
        "assistant",
        "tool",
        "tool",
        "assistant",
    ]
    expected = list(fixture["episode_ids"])
    # apply_chat_template closes the last turn with "<|im_end|>\n"; the trajectory ends at the sampled <|im_end|>
    assert chat.decode(expected[-1:]) == "\n" and expected[-2] == chat.im_end_id
    assert run.trajectory.tokens == expected[:-1]
    assert "<tools>" in chat.decode(run.trajectory.tokens) and run.trajectory.status == "ok"
    assert chat.renders_tools == (name.startswith("qwen"))  # Qwen2.5's template renders them; SmolLM2's does not
    torch, transformers = _transformers()
    if transformers is not None:
        tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
        tools = next(m["tools"] for m in messages if "tools" in m) if chat.renders_tools else None
        assert R.hf_apply(tokenizer, messages, tools, add_generation_prompt=False) == expected


@pytest.mark.slow
def test_a_warmup_demonstration_is_what_apply_chat_template_renders(real):
    """A demonstration of the warm-up's scripted teacher (two searches, an answer of ids) built with the
    checkpoint's chat template: its messages those of the fixture, its tokens exactly the ids transformers'
    ``apply_chat_template`` gives them (the fixture; live too with torch), its loss on the assistant turns."""
    name, directory, fixture, record, _, _ = real
    env, chat = R.environment(directory)
    run = R.teacher_demonstration(env, chat)
    assert run.episode.status == "ok" and run.messages == record["demo_messages"]
    assert [m["role"] for m in run.messages] == [
        "system",
        "user",
        "assistant",
        "tool",
        "assistant",
        "tool",
        "assistant",
    ]
    expected = list(fixture["demo_ids"])
    assert chat.decode(expected[-1:]) == "\n" and run.trajectory.tokens == expected[:-1]
    trained = chat.decode([t for t, m in zip(run.trajectory.tokens, run.trajectory.loss_mask) if m])
    assert trained == "".join(
        m["content"] + chat.decode([chat.im_end_id]) for m in run.messages if m["role"] == "assistant"
    )
    torch, transformers = _transformers()
    if transformers is not None:
        tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
        tools = R.tool_schemas(env) if chat.renders_tools else None
        assert R.hf_apply(tokenizer, run.messages, tools, add_generation_prompt=False) == expected


@pytest.mark.slow
def test_export_and_reload_is_lossless(real, tmp_path):
    _, _, _, _, model, params = real
    save_hf_checkpoint(model, params, tmp_path / "out")
    model2, params2 = load_hf_checkpoint(tmp_path / "out")
    assert model2.config == model.config
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), params, params2)


def _tiny_checkpoint(directory, tiny):
    """A tiny randomly initialised Llama checkpoint in HF format with ``directory``'s tokenizer and chat template."""
    import shutil

    from mtrl_jax.model import ModelConfig, init_params
    from mtrl_jax.model.transformer import Transformer

    hf = json.loads((directory / "config.json").read_text())
    hf.update(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1)
    hf["head_dim"] = 16
    cfg = ModelConfig.from_hf(hf)
    save_hf_checkpoint(Transformer(cfg), init_params(cfg, jax.random.PRNGKey(0)), tiny)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(directory / name, tiny / name)


def _recipe_skip():
    """Why the runs of configs/real_cpu.py below cannot run here, or None."""
    from conftest import SHARED_DATA

    directory = R.MODELS_DIR / "smollm2-135m-instruct"
    if not (directory / "fetch.json").exists():
        return (
            f"smollm2-135m-instruct not fetched (its weights, tokenizer and template are needed): python -m "
            f"tools.fetch_models --model smollm2-135m-instruct --out {directory}"
        )
    if not SHARED_DATA.is_dir():
        return f"shared IR collections not found at {SHARED_DATA}"
    return None


@background("recipe")
def _recipe_runs(root):
    """The two runs of configs/real_cpu.py below, started together (the one compiles while the other computes):
    ``{name: (return code, work directory, output)}``, or None when they cannot run here (``_recipe_skip``)."""
    import sys

    from conftest import SHARED_DATA as shared_data

    if _recipe_skip():
        return None
    directory = R.MODELS_DIR / "smollm2-135m-instruct"
    tiny = root / "tiny"
    _tiny_checkpoint(directory, tiny)
    folders = ",".join(str(shared_data / n) for n in ("scifact", "cranfield", "musique", "dbpedia_entity_5k"))
    workdir = smollm2_dir = root / "smollm2"
    smollm2 = [
        "--config=configs/real_cpu.py",
        f"--config.model.checkpoint={directory}",
        f"--workdir={workdir}",
        f"--config.data.folders={shared_data / 'cranfield'}",
        "--config.data.weights=1",
        "--config.data.dev_min=0",
        "--config.data.max_eval_tasks=2",
        "--config.max_steps=2",
        "--config.global_batch_size=2",
        "--config.rollout.group_size=2",
        "--config.rollout_max_concurrency=4",
        "--config.rollout.max_tokens_per_turn=24",
        "--config.rollout.decode_chunk=24",
        # the base model's episodes are one turn cut at 24 tokens (about 150 in all): 256 holds them, in one length
        # branch of the full-parameter update (the recipe's 1,024 in buckets of 128 compiles up to 8)
        "--config.rollout.max_len=256",
        "--config.rl.length_bucket=256",
        "--config.warmup.steps=0",  # the RL step alone, every parameter trained (the recipe: the test below)
        "--config.model.lora_rank=0",
        "--config.rl.micro_batches=2",
        "--config.rl.entropy_coef=0.01",
        "--config.optim.learning_rate=1e-4",
        "--config.checkpoint.every_steps=2",  # the last step's only: each is 1.6 GB (parameters and Adam moments)
        "--config.search.cache_dir=",
        "--config.search.encoder=tfidf",  # the recipe's plumbing: MiniLM would embed each corpus (minutes) here
        "--config.log.progress=False",
        "--config.rollout.precompile=False",
    ]
    workdir = tiny_dir = root / "tiny_run"
    recipe = [
        "--config=configs/real_cpu.py",
        f"--config.model.checkpoint={tiny}",
        f"--workdir={workdir}",
        f"--config.data.folders={folders}",
        "--config.data.max_eval_tasks=8",
        "--config.data.max_train_per_collection=16",  # 252 demonstrations drawn, not 2,240
        "--config.eval.before_warmup=True",
        "--config.warmup.steps=2",
        "--config.warmup.batch_size=4",
        "--config.warmup.micro_batches=2",
        "--config.max_steps=1",
        "--config.global_batch_size=2",
        "--config.rollout.group_size=2",
        "--config.rollout_max_concurrency=4",
        "--config.rl.micro_batches=1",
        "--config.rl.length_bucket=1024",  # one compiled branch of the update, not one per 128 tokens
        "--config.search.cache_dir=",
        "--config.search.encoder=tfidf",  # the recipe's plumbing: MiniLM would embed each corpus (minutes) here
        "--config.log.progress=False",
        "--config.rollout.precompile=False",
    ]
    runs = {
        name: (popen([sys.executable, "-m", "experiments.run", *args], root / f"{name}.txt", cwd=R.REPO), workdir)
        for name, args, workdir in (("smollm2", smollm2, smollm2_dir), ("tiny", recipe, tiny_dir))
    }
    return {
        name: (proc.wait(timeout=1500), workdir, (root / f"{name}.txt").read_text())
        for name, (proc, workdir) in runs.items()
    }


def _finished(name):
    """The work directory and output of the run ``name`` of ``_recipe_runs``, which ended well."""
    reason = _recipe_skip()
    if reason:
        pytest.skip(reason)
    code, workdir, out = background_result("recipe")[name]
    assert code == 0, out[-4000:]
    return workdir, out


@pytest.mark.slow
@pytest.mark.background("recipe")
def test_two_rl_steps_on_smollm2_change_the_parameters_and_keep_the_logprobs():
    """configs/real_cpu.py, shrunk: 2 RL steps of SmolLM2-135M-Instruct on Cranfield. An entropy bonus
    gives the step a gradient whatever the rewards (a base model's are often all equal)."""
    import orbax.checkpoint as ocp

    workdir, _ = _finished("smollm2")
    steps = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2]
    for s in steps:  # the sampler's (behaviour) and the update's recomputed log-probs of the same tokens
        assert s["train/behav_logp_max_abs_dev"] <= 1e-3, s["train/behav_logp_max_abs_dev"]
        assert s["train/grad_norm"] > 0
    state = ocp.CheckpointManager(workdir.absolute() / "checkpoints").restore(
        2, args=ocp.args.Composite(state=ocp.args.StandardRestore(), record=ocp.args.JsonRestore())
    )["state"]
    _, start = load_hf_checkpoint(R.MODELS_DIR / "smollm2-135m-instruct")
    moved = jax.tree.map(
        lambda a, b: float(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)).max()), start, state["params"]
    )
    assert max(jax.tree.leaves(moved)) > 1e-5


@pytest.mark.slow
@pytest.mark.background("recipe")
def test_the_recipe_runs_on_a_tiny_checkpoint_with_a_real_template():
    """configs/real_cpu.py end to end, shrunk to 2 warm-up steps and 1 RL step, on a tiny randomly
    initialised Llama checkpoint in HF format that carries SmolLM2's tokenizer and chat template: the base
    evaluation, the warm-up on the four collections' demonstrations, RL with LoRA, the evaluation after;
    no held-out query in the RL batch."""
    workdir, out = _finished("tiny")
    assert "[base policy] dev" in out and "[before RL] dev" in out and "[after RL] dev" in out
    assert re.search(r"warm-up on \d+ scripted demonstrations for 2 steps", out)
    summary = json.loads((workdir / "summary.json").read_text())
    for phase in ("base", "before", "after"):
        assert {"ndcg@10", "failure_rate", "mean_turns", "tool_calls_per_episode"} <= set(summary[phase])
        collections = {k.split("/")[0] for k in summary[phase]["by_type"]}
        assert collections <= {"scifact", "cranfield", "musique", "dbpedia_entity_5k"} and collections
    assert [json.loads(line)["step"] for line in (workdir / "metrics.jsonl").read_text().splitlines()] == [1]

    def task_ids(name):
        path = workdir / "trajectories" / f"{name}.jsonl"
        return {json.loads(line)["task_id"] for line in path.read_text().splitlines()}

    assert task_ids("step_000001") and not task_ids("step_000001") & task_ids("eval_before")
