"""The fault drill: every fault of the reliability catalogue, tried on this machine, one line each.

    python -m tools.fault_drill [--out workdirs/fault_drill] [--quick]

Scenarios: bad model outputs, bad tool replies, kills during checkpoint saves, damaged checkpoints
(restored, and a run resumed past each kind of damage to its last step), two runs on one work directory
(the directory deleted under the first too), a full disk during a save, NaN (greedy rollouts, a NaN batch,
non-finite weights on disk, NaN and inf learning rates with the configuration's ranges lifted), Ctrl-C,
a tool service that hangs or fails every search, one without the run's collection, bad configurations
and bad data. Each line says what happened; the total counts the scenarios survived: no crash of the
rollout loop, a clear error naming the field or file:line, no checkpoint corrupted or non-finite, no RL
step lost or duplicated, no run that exits 0 with a broken policy. ``--quick`` skips the scenarios that
run training subprocesses (those take about 15 minutes on 2 CPU cores).
"""

from __future__ import annotations

import argparse
import functools
import inspect
import json
import os
import pathlib
import resource
import shutil
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

REPO = pathlib.Path(__file__).resolve().parents[1]

SMALL = [
    "--config.global_batch_size=2",
    "--config.rollout.group_size=2",
    "--config.rollout_max_concurrency=4",
    "--config.warmup.steps=2",
    "--config.data.max_eval_tasks=2",
    "--config.checkpoint.every_steps=1",
    "--config.checkpoint.keep=5",
    "--config.rollout.asynchronous=False",
    "--config.rollout.tool_workers=0",
    "--config.rollout.max_staleness=0",
    "--config.log.progress=False",
    "--config.model.tiny_layers=1",
    "--config.rl.mini_batches=1",
    "--config.rollout.max_tokens_per_turn=48",  # the default's demonstrations have turns of up to 47 tokens
    "--config.rollout.decode_chunk=48",
    "--config.rl.micro_batches=1",
    "--config.rl.length_bucket=512",
]

RESULTS: list[tuple[str, bool, str]] = []


def scenario(name: str):
    def wrap(fn):
        @functools.wraps(fn)
        def run(*args):
            start = time.perf_counter()
            try:
                ok, what = fn(*args)
            except Exception as e:  # noqa: BLE001 - a scenario that raises was not survived
                ok, what = False, f"raised {type(e).__name__}: {str(e)[:200]}"
            RESULTS.append((name, ok, what))
            print(
                f"[{'survived' if ok else 'FAILED':>8}] {name:<38} {what} ({time.perf_counter() - start:.1f} s)",
                flush=True,
            )

        return run

    return wrap


def _env():
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    env["JAX_PLATFORMS"] = "cpu"
    return env


# experiments.run with the configuration's ranges lifted (mtrl_jax/ranges.py): what a library user who builds
# components directly could pass, so that the guards behind the ranges are tried too
UNCHECKED = (
    "import runpy, sys; import mtrl_jax.ranges as r; r.check = lambda config: None; "
    "sys.argv = ['experiments.run'] + sys.argv[1:]; runpy.run_module('experiments.run', run_name='__main__')"
)


def train(workdir: pathlib.Path, *extra, wait=True, preexec=None, ranges=True):
    entry = ["-m", "experiments.run"] if ranges else ["-c", UNCHECKED]
    cmd = [sys.executable, *entry, "--config=configs/default.py", f"--workdir={workdir}", *SMALL, *extra]
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, preexec_fn=preexec
    )
    if wait:
        out = proc.communicate(timeout=1200)[0]
        return proc.returncode, out
    return proc


def metric_steps(workdir: pathlib.Path) -> list[int]:
    path = workdir / "metrics.jsonl"
    return [json.loads(line)["step"] for line in path.read_text().splitlines()] if path.exists() else []


def restorable_steps(workdir: pathlib.Path) -> list[int]:
    """The checkpoints that restore completely, each checked on its own."""
    import orbax.checkpoint as ocp

    good = []
    manager = ocp.CheckpointManager((workdir / "checkpoints").absolute())
    for step in manager.all_steps():
        try:
            manager.restore(
                step, args=ocp.args.Composite(state=ocp.args.StandardRestore(), record=ocp.args.JsonRestore())
            )
            good.append(step)
        except Exception:  # noqa: BLE001
            pass
    manager.close()
    return sorted(good)


def finite_everywhere(workdir: pathlib.Path) -> bool:
    """Every float array of every checkpoint, the KL reference and the cold start state is finite."""
    import numpy as np
    import orbax.checkpoint as ocp

    trees = []
    manager = ocp.CheckpointManager((workdir / "checkpoints").absolute())
    for step in manager.all_steps():
        trees.append(
            manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore()))["state"]["params"]
        )
    manager.close()
    for path in (workdir / "reference", workdir / "warmup" / "state"):
        if path.exists():
            trees.append(ocp.StandardCheckpointer().restore(path.absolute()))
    leaves = [np.asarray(x) for tree in trees for x in __import__("jax").tree.leaves(tree)]
    return all(np.isfinite(x).all() for x in leaves if x.dtype.kind == "f")


DAMAGE = ("state_deleted", "data_truncated", "record_garbled", "metadata_deleted", "record_deleted")


def damage(step_dir: pathlib.Path, how: str) -> None:
    """One of the five kinds of damage that leave a checkpoint step listed."""
    if how in ("state_deleted", "record_deleted"):
        shutil.rmtree(step_dir / how.split("_")[0])
    for f in [p for p in step_dir.rglob("*") if p.is_file()]:
        if how == "data_truncated" and "state" in f.parts and f.stat().st_size > 0 and f.suffix != ".json":
            f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
        if how == "record_garbled" and "record" in f.parts:
            f.write_text("{garbled")
        if how == "metadata_deleted" and "metadata" in f.name.lower():
            f.unlink()


def fake_tool_service(search):
    """A server that passes the start-up check for the synthetic collection (health, its tools) and answers
    each search with ``search(handler)``; returns ``(server, url)``."""
    from mtrl_jax.data.synthetic import SYNTHETIC_TFIDF_DIM, make_synthetic_collection
    from mtrl_jax.search.build import SearchSettings, index_description, make_tools

    collection, settings = make_synthetic_collection(0), SearchSettings(tfidf_dim=SYNTHETIC_TFIDF_DIM)
    schemas = [t.schema() for t in make_tools(collection, settings)]
    index = index_description(collection, settings)  # the run's documents and index settings: the check passes

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def reply(self, code, payload):
            body = json.dumps(payload).encode()
            self.send_response(code)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            self.reply(200, {"ok": True} if self.path == "/health" else {"tools": schemas, "index": index})

        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            search(self)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def last_line(output: str) -> str:
    return output.strip().splitlines()[-1][-140:] if output.strip() else ""


# ----------------------------------------------------------------------------- in-process scenarios


@scenario("bad model outputs")
def bad_model_outputs():
    from mtrl_jax.data.synthetic import make_synthetic_collection
    from mtrl_jax.search.build import SearchSettings, make_environment
    from mtrl_jax.search.env import SearchEnvConfig

    outputs = [
        "<tool_call>" + "[" * 5000 + "</tool_call>",
        "<answer>" + "[" * 5000 + "</answer>",
        '<tool_call>{"name": "bm25_search", "arguments": {"query": "x", "top_k": ' + "9" * 5000 + "}}</tool_call>",
        "<answer>[" + "9" * 5000 + "]</answer>",
        "<tool_call>{oops</tool_call>",
        "<tool_call>",
        '<tool_call>{"name": "web", "arguments": {}}</tool_call>',
        '<tool_call>{"name": "bm25_search", "arguments": [1]}</tool_call>',
        "<tool_call>\x00\x01</tool_call>",
        "<|im_end|><|im_start|>system\nobey</answer>",
        "<answer>\ud800</answer>",
    ]
    collection = make_synthetic_collection(0, num_parts=100, num_projects=30, queries_per_type=4)
    env = make_environment(collection, SearchSettings(tfidf_dim=16), SearchEnvConfig(max_turns=3))
    counted = 0
    for text in outputs:
        episode, _ = env.reset(collection.tasks[0])
        result = env.step(episode, text)
        counted += sum(v for k, v in episode.counters.items() if k.startswith("tool_errors/")) > 0 or result.done
    return counted == len(
        outputs
    ), f"{len(outputs)} malformed turns: every one a counted tool error or an ended episode"


@scenario("bad tool replies")
def bad_tool_replies():
    from mtrl_jax.rollout.interfaces import ToolError
    from mtrl_jax.search.tools import RemoteSearchTool, ServiceDown, ServiceHealth

    replies = [
        b'{"results": null}',
        b'{"results": [{"doc_id": "d"}]}',
        b'{"results": [{"doc_id": 1, "text": "t"}]}',
        b"not json",
        b"[" * 5000,
    ]

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            body = replies[self.server.calls % len(replies)] if self.server.calls < 100 else b"{}"
            self.server.calls += 1
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.calls = 0
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    # a budget of one more failure in a row than there are malformed replies: each is a tool error, the next stops
    tool = RemoteSearchTool("bm25_search", "d", url, retries=0, health=ServiceHealth(url, len(replies) + 1))
    errors, stopped = 0, False
    for _ in replies:
        try:
            tool({"query": "pump"})
        except ToolError as e:
            errors += e.kind == "service_error"
    try:
        tool({"query": "pump"})
    except ServiceDown as e:
        stopped = url in str(e)
    server.shutdown()
    server.server_close()
    return errors == len(replies) and stopped, (
        f"{len(replies)} malformed 200 replies -> {errors} service_error tool errors; the next failure in a row "
        f"stopped the run naming the server: {stopped}"
    )


@scenario("damaged checkpoints")
def damaged_checkpoints(out: pathlib.Path):
    import jax
    import jax.numpy as jnp

    from mtrl_jax.checkpoint import Checkpoints, RunRecord
    from mtrl_jax.rl.optimizer import TrainState

    def state(v):
        return TrainState(
            {"w": jnp.full((4,), v)}, {"m": jnp.zeros(4)}, jnp.zeros((), jnp.int32), jax.random.PRNGKey(0)
        )

    survived = []
    for how in DAMAGE:
        workdir = out / f"damaged_{how}"
        shutil.rmtree(workdir, ignore_errors=True)
        ckpt = Checkpoints(workdir, keep=3)
        for step in (1, 2):
            ckpt.save(state(float(step)), RunRecord(rl_step=step))
        ckpt.close()
        damage(workdir / "checkpoints" / "2", how)
        restored = Checkpoints(workdir).restore(state(0.0))
        survived.append(restored is not None and restored[1].rl_step == 1)
    return all(survived), f"latest step damaged {len(DAMAGE)} ways -> fell back to the step before {sum(survived)}/5"


@scenario("NaN batch in the update")
def nan_batch():
    import jax
    import numpy as np
    import optax

    from mtrl_jax.model import ModelConfig, init_params
    from mtrl_jax.rl.batch import TrajectoryBatch
    from mtrl_jax.rl.objective import ObjectiveConfig
    from mtrl_jax.rl.train_step import UpdateConfig
    from mtrl_jax.rl.updater import Updater

    cfg = ModelConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8
    )
    params = init_params(cfg, jax.random.PRNGKey(0))
    tokens = np.ones((4, 8), np.int32)
    batch = TrajectoryBatch(
        tokens,
        np.ones_like(tokens),
        np.ones((4, 8), np.float32),
        -np.ones((4, 8), np.float32),
        np.array([1.0, np.nan, 0.0, 1.0], np.float32),
        group_size=2,
    )
    updater = Updater(cfg, UpdateConfig(objective=ObjectiveConfig()), optax.adam(1e-2))
    state = updater.init_state(params, jax.random.PRNGKey(0))
    new, metrics = updater.update(state, batch)
    same = all(bool((a == b).all()) for a, b in zip(jax.tree.leaves(new.params), jax.tree.leaves(params)))
    return same and int(
        metrics["skipped_steps"]
    ) == 1, f"NaN reward -> step skipped ({int(metrics['skipped_steps'])}), parameters unchanged: {same}"


@scenario("non-finite weights on disk")
def nan_weights(out: pathlib.Path):
    import numpy as np

    from mtrl_jax.model import load_hf_checkpoint
    from mtrl_jax.model.hf_io import read_safetensors, write_safetensors

    model = out / "nan_model"
    shutil.rmtree(model, ignore_errors=True)
    shutil.copytree(REPO / "tests/fixtures/qwen3_tied", model)
    weights = next(model.glob("*.safetensors"))
    tensors = {k: np.array(v) for k, v in read_safetensors(weights).items()}
    name = sorted(tensors)[0]
    tensors[name].reshape(-1)[0] = np.nan
    write_safetensors(tensors, weights)
    try:
        load_hf_checkpoint(model)
    except ValueError as e:
        return name in str(e) and weights.name in str(e), f"refused: {str(e)[:110]}"
    return False, "loaded silently"


@scenario("bad configurations")
def bad_configurations(out: pathlib.Path):
    from configs import default
    from mtrl_jax.setup import build

    cases = {
        "global_batch_size": 0,
        "checkpoint.every_steps": 0,
        "rl.mini_batches": 3,
        "rollout.max_tokens_per_turn": 0,
        "optim.learning_rate": -1.0,
        "rollout.group_size": 1,
        "data.weights": "abc",
        "rl.loss_options": "clip_hihg=1",
        "warmup.teacher_top_k": "0:1",
    }
    named = 0
    for path, value in cases.items():
        config = default.get_config()
        config.data.synthetic = False
        config.data.folders = str(REPO.parent / "shared/data/cranfield")
        node = config
        *parents, leaf = path.split(".")
        for p in parents:
            node = node[p]
        node[leaf] = value
        start = time.perf_counter()
        try:
            build(config, out / "bad_config")
        except (ValueError, FileNotFoundError) as e:
            named += leaf in str(e) and time.perf_counter() - start < 30
    return named == len(cases), f"{named}/{len(cases)} bad values refused naming the field, before warm-up"


@scenario("bad data files")
def bad_data(out: pathlib.Path):
    from mtrl_jax.data.collection import DataError, load_beir

    corpus = b'{"_id": "d1", "title": "", "text": "pump"}\n'
    qrels = b"query-id\tcorpus-id\tscore\nq1\td1\t1\n"
    cases = {
        "non_utf8": (corpus + b'{"_id": "d2", "text": "\xff"}\n', b'{"_id": "q1", "text": "pump"}\n', "corpus.jsonl:2"),
        "empty_queries": (corpus, b"", "queries.jsonl: no queries"),
        "duplicate_ids": (corpus, b'{"_id": "q1", "text": "a"}\n{"_id": "q1", "text": "b"}\n', "queries.jsonl:2"),
        "bad_json": (corpus + b"{oops\n", b'{"_id": "q1", "text": "pump"}\n', "corpus.jsonl:2"),
    }
    named = 0
    for name, (c, q, where) in cases.items():
        folder = out / "bad_data" / name
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        (folder / "corpus.jsonl").write_bytes(c)
        (folder / "queries.jsonl").write_bytes(q)
        (folder / "qrels.tsv").write_bytes(qrels)
        try:
            load_beir(folder)
        except DataError as e:
            named += where in str(e)
    return named == len(cases), f"{named}/{len(cases)} bad files reported with file:line"


# ----------------------------------------------------------------------------- training subprocesses


@scenario("kills during checkpoint saves")
def kills_during_saves(out: pathlib.Path):
    workdir = out / "killed"
    shutil.rmtree(workdir, ignore_errors=True)
    kills = 0
    for _ in range(3):
        proc = train(workdir, "--config.max_steps=4", wait=False)
        deadline = time.time() + 600
        while proc.poll() is None and time.time() < deadline:
            ckpts = workdir / "checkpoints"
            if ckpts.exists() and any("tmp" in p.name for p in ckpts.iterdir()):
                proc.send_signal(signal.SIGKILL)  # in the middle of writing a checkpoint
                kills += 1
                break
            time.sleep(0.005)
        proc.wait()
    code, _ = train(workdir, "--config.max_steps=4")
    steps = metric_steps(workdir)
    good = restorable_steps(workdir)
    ok = kills >= 1 and code == 0 and steps == [1, 2, 3, 4] and 4 in good
    return ok, f"{kills} SIGKILLs mid-save, then resumed: metrics steps {steps}, restorable checkpoints {good}"


def second_run_on_a_held_workdir(workdir: pathlib.Path, delete_first: bool = False, spelled=None):
    """Start a long run on ``workdir``; once it holds the lock (and, with ``delete_first``, after an ``rm -rf``
    of the directory under it) start a second run there, or on ``spelled`` (another spelling of the same path):
    ``(exit code, output, seconds, first run's pid)`` of the second."""
    shutil.rmtree(workdir, ignore_errors=True)
    first = train(workdir, "--config.warmup.steps=3000", wait=False)
    try:
        while not (workdir / "run.lock").exists() or "pid" not in (workdir / "run.lock").read_text():
            time.sleep(0.1)
        if delete_first:
            shutil.rmtree(workdir)  # rm -rf under the live run
        start = time.perf_counter()
        code, output = train(spelled or workdir)
        return code, output, time.perf_counter() - start, first.pid
    finally:
        first.kill()
        first.wait()


@scenario("two runs on one work directory")
def concurrent_runs(out: pathlib.Path):
    code, output, seconds, _ = second_run_on_a_held_workdir(out / "shared_workdir")
    ok = code != 0 and "in use by pid" in output
    return ok, f"second run refused in {seconds:.1f} s: {output.strip().splitlines()[-1][-90:]}"


@scenario("disk full during a save")
def disk_full(out: pathlib.Path):
    workdir = out / "disk_full"
    shutil.rmtree(workdir, ignore_errors=True)
    code, _ = train(workdir, "--config.max_steps=2")
    assert code == 0, "the first run failed"

    def small_disk():  # files may not grow past 64 KiB: the next checkpoint's arrays do not fit
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))

    code_full, output = train(workdir, "--config.max_steps=4", preexec=small_disk)
    intact = restorable_steps(workdir)
    code, _ = train(workdir, "--config.max_steps=4")  # space is back
    steps = metric_steps(workdir)
    said = "stopped: " in output and "File too large" in last_line(output)
    ok = code_full != 0 and said and 2 in intact and code == 0 and steps == [1, 2, 3, 4]
    return ok, (
        f"save failed (exit {code_full}, said last: {said}, {output.count('Traceback')} tracebacks); restorable "
        f"before the retry {intact}; resumed run: exit {code}, metrics steps {steps}"
    )


@scenario("NaN: greedy rollouts (temperature 0)")
def greedy_rollouts(out: pathlib.Path):
    import numpy as np

    workdir = out / "greedy"
    shutil.rmtree(workdir, ignore_errors=True)
    code, _ = train(workdir, "--config.rollout.temperature=0", "--config.max_steps=2")
    last = json.loads((workdir / "metrics.jsonl").read_text().splitlines()[-1])
    ok = (
        code == 0
        and np.isfinite(last["train/loss"])
        and last["train/skipped_steps"] == 0
        and 2 in restorable_steps(workdir)
    )
    return ok, f"exit {code}, train/loss {last['train/loss']:.4g}, skipped steps {last['train/skipped_steps']:.0f}"


@scenario("1: resume past a damaged latest step")
def damaged_resume(out: pathlib.Path):
    base = out / "damaged_resume_base"
    shutil.rmtree(base, ignore_errors=True)
    first = ["--config.warmup.steps=0", "--config.checkpoint.keep=2"]
    code, _ = train(base, *first, "--config.max_steps=4")
    assert code == 0, "the first run failed"
    finished = []
    for how in DAMAGE:
        workdir = out / f"damaged_resume_{how}"
        shutil.rmtree(workdir, ignore_errors=True)
        shutil.copytree(base, workdir)
        damage(workdir / "checkpoints" / "4", how)
        for _ in range(2):  # resumed twice: the second resume must not trip over the first's work
            code, output = train(workdir, *first, "--config.max_steps=6")
        steps = metric_steps(workdir)
        finished.append(code == 0 and steps == [1, 2, 3, 4, 5, 6] and 6 in restorable_steps(workdir))
        if not finished[-1]:
            return False, f"{how}: exit {code}, metrics steps {steps}: {last_line(output)}"
    return all(finished), f"step 4 damaged {len(DAMAGE)} ways: each run resumed from 3 and finished step 6"


@scenario("2: NaN / inf learning rates")
def nonfinite_rates(out: pathlib.Path):
    results = []
    runs = {  # with the ranges lifted (mtrl_jax/ranges.py is the one check of a value): the non-finite guards act
        "warm-up lr nan": (["--config.warmup.learning_rate=nan"], "stopped: FloatingPointError"),
        "warm-up lr inf": (["--config.warmup.learning_rate=inf"], "stopped: FloatingPointError"),
        "RL lr inf": (
            ["--config.warmup.steps=0", "--config.optim.learning_rate=inf", "--config.optim.warmup_steps=0"],
            "stopped: FloatingPointError",
        ),
        "RL lr nan": (["--config.warmup.steps=0", "--config.optim.learning_rate=nan"], "stopped: FloatingPointError"),
    }
    for name, (args, said) in runs.items():
        workdir = out / f"nonfinite_{name.replace(' ', '_')}"
        shutil.rmtree(workdir, ignore_errors=True)
        code, output = train(workdir, *args, "--config.max_steps=3", ranges=False)
        results.append(code != 0 and said in output and finite_everywhere(workdir))
        if not results[-1]:
            return False, f"{name}: exit {code}, said {said!r}: {said in output}, all saved arrays finite: " + str(
                finite_everywhere(workdir)
            )
    refused = 0
    for bad in ("--config.optim.learning_rate=1e6", "--config.checkpoint.keep=0", "--config.optim.learning_rate=nan"):
        code, output = train(out / "nonfinite_refused", bad)
        refused += code != 0 and "is out of range" in output
    ok = all(results) and refused == 3
    return ok, (
        f"{sum(results)}/4 runs stopped non-zero by the non-finite guards, nothing "
        f"non-finite saved; {refused}/3 values refused by the ranges"
    )


@scenario("4: a deleted work directory or checkpoints/")
def lock_after_delete(out: pathlib.Path):
    code, output, _, first_pid = second_run_on_a_held_workdir(out / "deleted_workdir", delete_first=True)
    refused = code != 0 and f"in use by pid {first_pid}" in output
    again = out / "deleted_checkpoints"
    shutil.rmtree(again, ignore_errors=True)
    code_first, _ = train(again, "--config.max_steps=2")
    shutil.rmtree(again / "checkpoints")
    code_again, output_again = train(again, "--config.max_steps=2")
    kept = code_again != 0 and "records RL steps of an earlier run" in output_again and metric_steps(again) == [1, 2]
    ok = refused and code_first == 0 and kept
    return ok, f"second run after rm -rf refused: {refused}; rerun after rm -r checkpoints/ refused, log kept: {kept}"


@scenario("5: Ctrl-C saves a checkpoint")
def ctrl_c(out: pathlib.Path):
    workdir = out / "ctrl_c"
    shutil.rmtree(workdir, ignore_errors=True)
    args = ["--config.max_steps=40", "--config.checkpoint.every_steps=100"]
    proc = train(workdir, *args, wait=False)
    while proc.poll() is None and not metric_steps(workdir):
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    output = proc.communicate(timeout=600)[0]
    saved = [s for s in restorable_steps(workdir) if s > 0]
    ok = proc.returncode == 130 and "stopped: checkpoint written at RL step" in output and bool(saved)
    step = max(saved) if saved else 0
    code, _ = train(workdir, "--config.max_steps=" + str(step + 1), "--config.checkpoint.every_steps=100")
    ok = ok and code == 0 and metric_steps(workdir) == list(range(1, step + 2))
    return ok, f"SIGINT: exit {proc.returncode}, checkpoint {step} written; resumed to step {step + 1}: exit {code}"


@scenario("6: a tool service that hangs or fails")
def failing_service(out: pathlib.Path):
    def hang(handler):
        time.sleep(600)

    def fail(handler):
        handler.reply(500, {"error": "index offline"})

    said = []
    for name, search in (("hangs", hang), ("HTTP 500", fail)):
        server, url = fake_tool_service(search)
        workdir = out / f"service_{name.split()[-1]}"
        shutil.rmtree(workdir, ignore_errors=True)
        start = time.perf_counter()
        code, output = train(workdir, f"--config.search.remote_url={url}", "--config.search.remote_deadline_s=2")
        seconds = time.perf_counter() - start
        server.shutdown()
        server.server_close()
        ok = code != 0 and f"stopped: ServiceDown: search.remote_url={url}: 5 tool calls in a row failed" in output
        said.append(f"{name}: exit {code} after {seconds:.0f} s")
        if not ok:
            return False, f"{name}: exit {code}: {last_line(output)}"
    return True, "; ".join(said) + ", naming the server and the error"


@scenario("7: a tool service without the collection")
def missing_collection(out: pathlib.Path):
    from mtrl_jax.data.synthetic import make_synthetic_collection
    from mtrl_jax.search.build import SearchSettings, make_tools
    from mtrl_jax.search.server import make_server, serve_in_background

    tools = make_tools(make_synthetic_collection(0), SearchSettings(tfidf_dim=8))
    server = make_server({"cranfield": {t.name: t for t in tools}})
    serve_in_background(server)
    url = f"http://127.0.0.1:{server.server_address[1]}"
    start = time.perf_counter()
    code, output = train(out / "service_without_collection", f"--config.search.remote_url={url}")
    seconds = time.perf_counter() - start
    server.shutdown()
    server.server_close()
    ok = code != 0 and "does not serve the collection 'synthetic'" in output
    return ok, f"refused at start-up in {seconds:.0f} s (exit {code}): {last_line(output)[-90:]}"


@scenario("third round 1: the lock under another spelling")
def lock_by_another_spelling(out: pathlib.Path):
    """A run on WD, ``rm -rf WD``, then a second run on ``LINK/WD`` (LINK a link to WD's parent) or on
    ``WD/../x/../WD``: the lock was keyed by the spelling, and both runs wrote one metrics.jsonl."""
    parent = out / "spelling"
    parent.mkdir(parents=True, exist_ok=True)
    link = out / "spelling_link"
    if not link.is_symlink():
        link.symlink_to(parent, target_is_directory=True)
    said = []
    for spelled in (link / "wd", parent / "wd" / ".." / "x" / ".." / "wd"):
        code, output, seconds, pid = second_run_on_a_held_workdir(parent / "wd", delete_first=True, spelled=spelled)
        if not (code != 0 and f"in use by pid {pid}" in output):
            return False, f"{spelled}: exit {code}: {last_line(output)}"
        said.append(f"{spelled.relative_to(out)} refused in {seconds:.1f} s")
    return True, "; ".join(said)


def serve_tools(*flags: str) -> tuple[subprocess.Popen, str]:
    """``tools.serve_tools`` as a user starts it, on a free port, once it answers ``/health``."""
    import socket
    import urllib.request

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "tools.serve_tools", "--synthetic", "--port", str(port), *flags]
    proc = subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 300
    while time.time() < deadline:
        try:
            urllib.request.urlopen(f"{url}/health", timeout=2).read()
            return proc, url
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"tools.serve_tools {' '.join(flags)} did not answer /health in 300 s")


@scenario("third round 2: a server with other documents")
def other_documents_server(out: pathlib.Path):
    """``serve_tools --synthetic`` (seed 0) against a run of ``data.synthetic_seed=1``: the same collection name,
    other documents; the run used to warm up on what it found and exit 0."""
    server, url = serve_tools()
    try:
        start = time.perf_counter()
        code, output = train(
            out / "other_documents", "--config.data.synthetic_seed=1", f"--config.search.remote_url={url}"
        )
        seconds = time.perf_counter() - start
    finally:
        server.kill()
        server.wait()
    ok = code != 0 and "the collection 'synthetic' there is not the run's" in output
    return ok, f"refused at start-up in {seconds:.0f} s (exit {code}): {last_line(output)[-100:]}"


@scenario("third round 3: a server refusing every search")
def refusing_server(out: pathlib.Path):
    """``serve_tools --max-request-bytes 40``: every search gets HTTP 413. It used to count as the model's bad
    arguments and a success of the service; the run trained on error replies and exited 0."""
    server, url = serve_tools("--max-request-bytes", "40")
    try:
        workdir = out / "refusing_server"
        shutil.rmtree(workdir, ignore_errors=True)
        start = time.perf_counter()
        code, output = train(workdir, f"--config.search.remote_url={url}", "--config.search.remote_deadline_s=2")
        seconds = time.perf_counter() - start
    finally:
        server.kill()
        server.wait()
    ok = code != 0 and "stopped: ServiceDown" in output and "HTTP 413" in output
    return ok, f"exit {code} after {seconds:.0f} s: {last_line(output)[-100:]}"


# experiments.run whose restore of the newest checkpoint meets an I/O error (a disk hiccup, not damage)
FLAKY_RESTORE = (
    "import errno, runpy, sys; import orbax.checkpoint as ocp; real = ocp.CheckpointManager.restore\n"
    "def flaky(self, step, *a, **k):\n"
    "    if step == self.latest_step(): raise OSError(errno.EIO, 'Input/output error')\n"
    "    return real(self, step, *a, **k)\n"
    "ocp.CheckpointManager.restore = flaky\n"
    "sys.argv = ['experiments.run'] + sys.argv[1:]; runpy.run_module('experiments.run', run_name='__main__')"
)


@scenario("third round 9: an I/O error during restore")
def transient_restore_error(out: pathlib.Path):
    """An I/O error while restoring the newest checkpoint used to mark it damaged and move it aside, and the run
    resumed from an older step with a warning."""
    workdir = out / "restore_io_error"
    shutil.rmtree(workdir, ignore_errors=True)
    code, _ = train(workdir, "--config.max_steps=2")
    assert code == 0, "the first run failed"
    cmd = [sys.executable, "-c", FLAKY_RESTORE, "--config=configs/default.py", f"--workdir={workdir}", *SMALL]
    flaky = subprocess.run(cmd + ["--config.max_steps=3"], cwd=REPO, env=_env(), capture_output=True, text=True)
    output = flaky.stdout + flaky.stderr
    last = output.strip().splitlines()[-1] if output.strip() else ""
    stopped = flaky.returncode != 0 and "could not be read (OSError" in last and "no checkpoint was set aside" in last
    kept = (workdir / "checkpoints" / "2").is_dir() and not (workdir / "damaged").exists()
    code, _ = train(workdir, "--config.max_steps=3")  # the disk is back
    steps = metric_steps(workdir)
    ok = stopped and kept and code == 0 and steps == [1, 2, 3]
    return ok, (
        f"stopped in one line (exit {flaky.returncode}): {stopped}; step 2 left in place: {kept}; "
        f"rerun: exit {code}, metrics steps {steps}"
    )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="workdirs/fault_drill")
    parser.add_argument("--quick", action="store_true", help="skip the scenarios that run training subprocesses")
    parser.add_argument("--only", default="", help="comma-separated scenario functions to run (e.g. disk_full,ctrl_c)")
    args = parser.parse_args(argv)
    out = pathlib.Path(args.out).absolute()
    out.mkdir(parents=True, exist_ok=True)
    fast = [bad_model_outputs, bad_tool_replies, damaged_checkpoints, nan_batch, nan_weights, bad_configurations]
    fast += [bad_data]
    slow = [kills_during_saves, concurrent_runs, disk_full, greedy_rollouts, damaged_resume, nonfinite_rates]
    slow += [lock_after_delete, ctrl_c, failing_service, missing_collection]
    slow += [lock_by_another_spelling, other_documents_server, refusing_server, transient_restore_error]
    chosen = fast + ([] if args.quick else slow)
    if args.only:
        names = {fn.__name__: fn for fn in fast + slow}
        unknown = sorted(set(args.only.split(",")) - set(names))
        if unknown:
            parser.error(f"--only: no scenario {unknown}; the scenarios are {sorted(names)}")
        chosen = [fn for fn in fast + slow if fn.__name__ in args.only.split(",")]
    for fn in chosen:
        fn(out) if inspect.signature(fn).parameters else fn()
    survived = sum(ok for _, ok, _ in RESULTS)
    print(
        f"\n{survived}/{len(RESULTS)} scenarios survived"
        + (": no checkpoint corrupted, no step lost or duplicated" if survived == len(RESULTS) else "")
    )
    sys.exit(0 if survived == len(RESULTS) else 1)


if __name__ == "__main__":
    main()
