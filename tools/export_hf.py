"""Export a trained work directory's policy as an HF checkpoint directory that transformers loads.

    python -m tools.export_hf --config=configs/real_cpu.py --checkpoint=workdirs/real_cpu --out=exported/real_cpu
    python -m tools.export_hf --config=configs/real_cpu.py --checkpoint=workdirs/real_cpu --out=exported/adapters --peft

The parameters of the work directory's latest intact checkpoint, read with the config the run used (the
same ``--config.*`` overrides). LoRA adapters are folded into the base weights (``W + (alpha / r) A B``),
so the export is a plain model; with ``--peft`` the adapters alone are written in PEFT's layout
(``adapter_config.json``, ``adapter_model.safetensors``) for the run's base checkpoint. The vocabulary's
padding is dropped. The tokenizer files of the base checkpoint (or the tiny default's trained
``tokenizer.json`` from the work directory) are copied beside the weights.
"""

if __name__ == "__main__":  # first: the host allocator (glibc reads its tunables when the process starts)
    from mtrl_jax.host import prepare_process

    prepare_process()

import argparse
import pathlib
import shutil

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


def export(config, workdir, out, peft: bool = False) -> pathlib.Path:
    """Write ``workdir``'s latest policy to ``out`` (see the module's docstring); returns ``out``."""
    from mtrl_jax.evaluate import trained_policy
    from mtrl_jax.model import lora, save_hf_checkpoint
    from mtrl_jax.model.transformer import Transformer

    workdir, out = pathlib.Path(workdir), pathlib.Path(out)
    if out.resolve() == workdir.resolve() or workdir.resolve() in out.resolve().parents:
        raise ValueError(
            f"--out {out} is inside the work directory {workdir}: its files (config.json) would be overwritten"
        )
    if peft and config.warmup.steps and config.warmup.train_base:
        raise ValueError(
            "--peft: with warmup.train_base the adapters were trained over the warmed-up base, not over "
            f"{config.model.checkpoint or 'the initial model'}; PEFT would load them over the wrong base. Export the "
            "merged policy instead (without --peft)"
        )
    components, params = trained_policy(config, workdir)
    cfg = components.model_cfg
    if peft:
        if not cfg.lora_rank:
            raise ValueError(f"--peft: the run trained no adapters (model.lora_rank={cfg.lora_rank})")
        lora.save_peft_adapters(cfg, params, out, base_model=config.model.checkpoint or None)
    else:
        merged_cfg, merged = lora.merged_weights(cfg, params)
        save_hf_checkpoint(Transformer(merged_cfg), merged, out)
    source = pathlib.Path(config.model.checkpoint) if config.model.checkpoint else workdir
    for name in TOKENIZER_FILES:
        if (source / name).exists():
            shutil.copyfile(source / name, out / name)
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/default.py", help="the run's config file")
    parser.add_argument("--checkpoint", required=True, help="a training work directory (its latest checkpoint)")
    parser.add_argument("--out", required=True, help="the directory to write")
    parser.add_argument("--peft", action="store_true", help="write the LoRA adapters alone, in PEFT's layout")
    args, overrides = parser.parse_known_args(argv)
    unknown = [o for o in overrides if not o.startswith("--config.")]
    if unknown:
        parser.error(f"unrecognized arguments: {unknown} (the run's overrides are --config.<field>=<value>)")
    from experiments.sweep import load_config

    out = export(load_config(args.config, overrides), args.checkpoint, args.out, args.peft)
    print(f"{out}: {'PEFT adapters' if args.peft else 'HF checkpoint'} of {args.checkpoint}")


if __name__ == "__main__":
    main()
